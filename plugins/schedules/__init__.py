"""Pipeline schedules, one plugin each, built on torch.distributed.pipelining."""


def rounds_refusal(microbatches: int, pp: int) -> str | None:
    """Why torch's interleaved schedules cannot split ``microbatches`` into max(1, M // pp) equal rounds."""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return f"{microbatches} microbatches do not form {rounds} equal rounds; use a multiple of pp = {pp}"
    return None
