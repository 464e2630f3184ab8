"""Shape buckets: few padded sizes, so the jitted step compiles a bounded number of times."""

from __future__ import annotations

import bisect
import dataclasses


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2·low, 4·low, ... up to and always including `high`."""
    sizes, size = [], max(1, low)
    while size < high:
        sizes.append(size)
        size *= 2
    sizes.append(high)
    return tuple(sizes)


def pick(size: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `size`."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    tokens: tuple[int, ...]  # flattened new tokens of a step
    seqs: tuple[int, ...]  # requests in a step
    blocks: tuple[int, ...]  # block-table width (blocks of the longest request)
    query_len: tuple[int, ...]  # new tokens of the longest request (1 for decode-only steps)

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int) -> StepBuckets:
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        return cls(
            tokens=powers_of_two(16, max_tokens),
            seqs=powers_of_two(8, max_num_seqs),
            blocks=powers_of_two(4, max_blocks_per_seq),
            query_len=powers_of_two(1, max_num_batched_tokens),
        )

    def mixed_step_seqs(self, tokens_padded: int) -> int:
        """The request bucket of a pinned step with a prefill in it: one per token bucket, as many rows as the
        tokens allow. Each pair of buckets would be its own forward program (the largest thing start-up compiles
        or loads); the padded rows cost only their LM-head rows, which read no more weights."""
        return pick(min(tokens_padded, self.seqs[-1]), self.seqs)
