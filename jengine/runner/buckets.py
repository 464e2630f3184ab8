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
    # the block-table widths of a pinned runner's decode-only steps: the widest bucket whose attention needs no
    # merge launch (where one is narrower than the whole table), then the whole table
    decode_blocks: tuple[int, ...] = ()

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
              one_split_blocks: int | None = None) -> StepBuckets:
        """`one_split_blocks`: the table width up to which a decode step's attention is one launch
        (`AttentionBackend.one_split_positions`, in blocks)."""
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        blocks = powers_of_two(4, max_blocks_per_seq)
        narrow = [b for b in blocks if one_split_blocks and b <= one_split_blocks]
        decode_blocks = (narrow[-1], blocks[-1]) if narrow and narrow[-1] < blocks[-1] else (blocks[-1],)
        return cls(
            tokens=powers_of_two(16, max_tokens),
            seqs=powers_of_two(8, max_num_seqs),
            blocks=blocks,
            query_len=powers_of_two(1, max_num_batched_tokens),
            decode_blocks=decode_blocks,
        )

    def mixed_step_seqs(self, tokens_padded: int) -> int:
        """The request bucket of a pinned step with a prefill in it: one per token bucket, as many rows as the
        tokens allow. Each pair of buckets would be its own forward program (the largest thing start-up compiles
        or loads); the padded rows cost only their LM-head rows, which read no more weights."""
        return pick(min(tokens_padded, self.seqs[-1]), self.seqs)
