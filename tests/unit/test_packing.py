"""Dynamic micro-batching layouts against hand-computed values."""

from __future__ import annotations

import pytest

from backends.train.packing import (
    balance_across_ranks,
    computed_tokens,
    dynamic_layout,
    fixed_layout,
    pack_padded,
    pack_padding_free,
)

# index:     0  1  2  3  4  5
LENGTHS = [10, 3, 7, 2, 8, 5]


def test_ranks_get_balanced_tokens_longest_first():
    # sorted: 0(10) 4(8) 2(7) 5(5) 1(3) 3(2); each goes to the rank with fewest tokens (ties: rank 0)
    # 0->r0 (10), 4->r1 (8), 2->r1 (15), 5->r0 (15), 1->r0 (18, tie 15/15), 3->r1 (17)
    assert balance_across_ranks(LENGTHS, 2) == [[0, 5, 1], [4, 2, 3]]


def test_balance_with_more_ranks_than_sequences_leaves_ranks_empty():
    assert balance_across_ranks([4, 9], 3) == [[1], [0], []]


def test_padded_packing_bounds_count_times_longest():
    # r0 sorted 0(10) 5(5) 1(3): 2*10 > 16 -> new; 2*5 <= 16 -> together
    assert pack_padded([0, 5, 1], LENGTHS, 16) == [[0], [5, 1]]
    # r1 sorted 4(8) 2(7) 3(2): 2*8 <= 16; 3*8 > 16 -> new
    assert pack_padded([4, 2, 3], LENGTHS, 16) == [[4, 2], [3]]


def test_padding_free_packing_is_first_fit_decreasing():
    assert pack_padding_free([0, 5, 1], LENGTHS, 16) == [[0, 5], [1]]
    # 0(10) | 4(8): 18 > 16, new | 2(7): into [4] (15) | 5(5): into [0] (15) | 1(3): new | 3(2): into [1]
    assert pack_padding_free(range(6), LENGTHS, 16) == [[0, 5], [4, 2], [1, 3]]


@pytest.mark.parametrize("pack", [pack_padded, pack_padding_free])
def test_a_sequence_over_budget_gets_its_own_micro_batch(pack):
    assert pack([0, 1, 2], [20, 3, 2], 8) == [[0], [1, 2]]


def test_dynamic_layout_counts_and_efficiency():
    layout = dynamic_layout(LENGTHS, 2, 16, "padded")
    assert layout.per_rank == (((0,), (5, 1)), ((4, 2), (3,)))
    assert layout.num_microbatches == 2
    assert layout.padding_microbatches() == 0
    assert layout.rank_tokens(LENGTHS) == [18, 17]
    # slots: [0] 10, [5,1] 2*5, [4,2] 2*8, [3] 2 -> 38 for 35 real tokens
    assert layout.packing_efficiency(LENGTHS) == pytest.approx(35 / 38)
    assert layout.rank_imbalance(LENGTHS) == pytest.approx(18 / 17.5)


def test_padding_free_layout_has_no_padding():
    layout = dynamic_layout(LENGTHS, 2, 16, "padding_free")
    assert layout.packing_efficiency(LENGTHS) == 1.0


def test_ranks_with_fewer_micro_batches_get_padding_ones():
    # 0 -> r0, 1 -> r1, 2 -> r0 (tie 9/9), 3 -> r1; budget 10 keeps 9-token sequences apart
    layout = dynamic_layout([9, 9, 9, 1], 2, 10, "padded")
    assert layout.per_rank == (((0,), (2,)), ((1,), (3,)))
    uneven = dynamic_layout([9, 1, 1], 2, 10, "padded")
    assert uneven.per_rank == (((0,),), ((1, 2),))
    skewed = dynamic_layout([9, 8, 8], 2, 10, "padded")
    assert skewed.per_rank == (((0,),), ((1,), (2,)))
    assert skewed.num_microbatches == 2
    assert skewed.padding_microbatches(0) == 1 and skewed.padding_microbatches(1) == 0
    assert skewed.padding_microbatches() == 1


def test_fixed_layout_is_strided_and_counted():
    layout = fixed_layout(5, 2, 2)
    assert layout.per_rank == (((0, 2), (4,)), ((1, 3),))
    assert layout.num_microbatches == 2
    assert layout.padding_microbatches(1) == 1


def test_computed_tokens():
    assert computed_tokens([0, 1], LENGTHS, "padded") == 20
    assert computed_tokens([0, 1], LENGTHS, "padding_free") == 13
    assert computed_tokens([], LENGTHS, "padded") == 0


def test_padded_packing_trades_padding_against_micro_batch_overhead():
    lengths = [10, 3, 3, 3]
    # without overhead, separating the long sequence saves 21 padded slots: 10 + 3*3 < 4*10
    assert pack_padded(range(4), lengths, 40, overhead_tokens=0) == [[0], [1, 2, 3]]
    # with a large per-micro-batch cost, one padded micro-batch is cheaper: 40 + 128 < 19 + 2*128
    assert pack_padded(range(4), lengths, 40, overhead_tokens=128) == [[0, 1, 2, 3]]
