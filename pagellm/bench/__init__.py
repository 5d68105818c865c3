"""`pagellm bench ...`: throughput, single-stream latency, serving and memory benchmarks against the peers."""


class BenchError(Exception):
    """A benchmark that cannot go on (a server that does not start or answer, every request
    failed): the CLI prints the message, without a traceback, and exits 1."""
