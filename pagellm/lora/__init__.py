"""LoRA adapters over one base model (vLLM's multi-LoRA): requests name an adapter, each step computes
every row with its own adapter. This package imports nothing of pagellm; ``request`` and ``peft_config``
are light (no torch), the rest is torch."""
