"""Running one model over several processes: tensor parallelism on torch.distributed."""
