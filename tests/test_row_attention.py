"""The project's row attention kernel (pipeline/reference/row_attention.py): softmax attention to float32 accuracy,
every row alone over its own keys, so its bits never depend on the other rows or the thread count; the model takes
it for batch-invariant float32 forwards and gives the SDPA path's logits to float32 accuracy. Each build runs where
its CPU features are (the AVX2 one on AVX-512 CPUs too); the others skip (the model's SDPA path is tested in
tests/test_model.py)."""

import functools
import math

import pytest
import torch

from pipeline.reference import row_attention
from pipeline.reference.model import LlamaModel, SequenceInput
from tests.test_model import BLOCK, blocks_for, random_ids

needs_kernel = pytest.mark.skipif(not row_attention.AVX2.cpu_supported(), reason="every build needs at least AVX2")
# the two builds of the kernel
ISAS = pytest.mark.parametrize("isa", [
    pytest.param(row_attention.AVX512, marks=pytest.mark.skipif(not row_attention.AVX512.cpu_supported(), reason="no AVX-512")),
    pytest.param(row_attention.AVX2, marks=pytest.mark.skipif(not row_attention.AVX2.cpu_supported(), reason="no AVX2")),
], ids=["avx512", "avx2"])


def reference(q, k, v, slots, starts, lengths) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float64, row by row, query head h reading KV head h // (H // KVH)."""
    H, KVH, D = q.shape[1], k.shape[1], q.shape[2]
    rows = []
    for r in range(q.shape[0]):
        keys = slots[starts[r]:starts[r] + lengths[r]]
        ks, vs = k[keys].double(), v[keys].double()  # [S, KVH, D]
        heads = [torch.softmax(ks[:, h // (H // KVH)] @ q[r, h].double() / math.sqrt(D), 0) @ vs[:, h // (H // KVH)]
                 for h in range(H)]
        rows.append(torch.cat(heads))
    return torch.stack(rows)


@ISAS
@pytest.mark.parametrize("heads, kv_heads, head_size", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 16), (18, 1, 256)])
def test_rows_attend_over_their_own_keys_to_float32_accuracy_and_alone(heads, kv_heads, head_size, isa):
    attend = functools.partial(row_attention.row_attention, isa=isa)
    assert row_attention.kernel() is (row_attention.AVX512 if row_attention.AVX512.cpu_supported() else row_attention.AVX2)
    g = torch.Generator().manual_seed(heads * head_size)
    k, v = torch.randn(600, kv_heads, head_size, generator=g), torch.randn(600, kv_heads, head_size, generator=g)
    q = torch.randn(8, heads, head_size, generator=g) * 3
    slots = torch.randperm(600, generator=g)
    starts = torch.tensor([0, 0, 0, 0, 10, 10, 200, 599])
    lengths = torch.tensor([1, 15, 16, 17, 300, 301, 400, 1])  # across 16-lane chunk boundaries
    keys = (slots, starts, lengths)
    out = attend(q, k, v, keys, 1 / math.sqrt(head_size))
    assert (out.double() - reference(q, k, v, *keys)).abs().max() < 1e-5
    alone = torch.cat([attend(q[r:r + 1], k, v, (slots, starts[r:r + 1], lengths[r:r + 1]),
                                                   1 / math.sqrt(head_size)) for r in range(len(q))])
    assert torch.equal(alone, out)  # a row's bits do not depend on the other rows
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(attend(q, k, v, keys, 1 / math.sqrt(head_size)), out)
    finally:
        torch.set_num_threads(before)


@ISAS
def test_a_prefills_rows_keep_their_bits_across_work_items_and_threads(isa):
    """A 40-row prompt (the kernel splits a sequence's rows into work items of 16) and a 3-row verify of another
    sequence: every row equals itself computed alone, on one thread or two, and softmax attention to float32
    accuracy."""
    attend = functools.partial(row_attention.row_attention, isa=isa)
    g = torch.Generator().manual_seed(40)
    k, v = torch.randn(128, 3, 64, generator=g), torch.randn(128, 3, 64, generator=g)
    q = torch.randn(43, 9, 64, generator=g) * 3
    slots = torch.randperm(128, generator=g)
    starts = torch.tensor([0] * 40 + [40] * 3)
    lengths = torch.tensor(list(range(1, 41)) + [70, 71, 72])
    keys = (slots, starts, lengths)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(attend(q, k, v, keys, 0.125))
    finally:
        torch.set_num_threads(before)
    alone = torch.cat([attend(q[r:r + 1], k, v, (slots, starts[r:r + 1], lengths[r:r + 1]), 0.125)
                       for r in range(len(q))])
    assert torch.equal(outs[0], alone) and torch.equal(outs[1], alone)
    assert (alone.double() - reference(q, k, v, *keys)).abs().max() < 1e-5


@ISAS
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1), (4, 4)])
def test_a_verifys_query_heads_split_across_threads_keep_their_bits(heads, kv_heads, isa):
    """A verify of one sequence gives fewer work items than twice the threads: the kernel splits a KV head's query
    heads into items of their own. The same bits as one thread computing each KV head whole, for any such split."""
    attend = functools.partial(row_attention.row_attention, isa=isa)
    g = torch.Generator().manual_seed(heads)
    k, v = torch.randn(300, kv_heads, 64, generator=g), torch.randn(300, kv_heads, 64, generator=g)
    q = torch.randn(6, heads, 64, generator=g) * 3
    keys = (torch.randperm(300, generator=g), torch.zeros(6, dtype=torch.long), torch.arange(252, 258))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 4):  # 1: one item per KV head; 2 and 4: parts of its query heads
            torch.set_num_threads(threads)
            outs.append(attend(q, k, v, keys, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    assert (outs[0].double() - reference(q, k, v, *keys)).abs().max() < 1e-5


@ISAS
def test_a_team_thread_computes_the_work_items_left_with_the_calls_bits(isa):
    """row_attention_into, as each thread of a fused forward's team calls it (csrc/fused_layers.cpp): every caller
    plans the same work items and takes those left in its phase of the shared tickets (csrc/shared_items.h: [next,
    finished, count]). Whichever callers take which items, together they write row_attention's result; a caller that
    finds none left writes nothing."""
    attend = functools.partial(row_attention.row_attention, isa=isa)
    into = row_attention._op("row_attention_into", isa)
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(128, 3, 64, generator=g), torch.randn(128, 3, 64, generator=g)
    q = torch.randn(26, 9, 64, generator=g) * 3  # a 20-row prompt (two row groups) and a 6-row verify
    keys = (torch.randperm(128, generator=g), torch.tensor([0] * 20 + [20] * 6),
            torch.tensor(list(range(1, 21)) + list(range(90, 96))))
    want = attend(q, k, v, keys, 0.125)
    for threads in (1, 2, 3):  # the plan's items (a KV head's query heads split for more threads)
        out, tickets = torch.full_like(want, float("nan")), torch.zeros(2, 8, dtype=torch.long)
        into(q, k, v, *keys, 0.125, out, tickets, 1, threads)
        assert torch.equal(out, want) and tickets[0].eq(0).all()  # phase 1's row only
        items = tickets[1, 2].item()
        assert tickets[1, 1].item() == items >= 6
        for taken in range(items):  # the first `taken` items went to another thread: some rows' heads stay unwritten
            part, tickets = torch.full_like(want, float("nan")), torch.zeros(1, 8, dtype=torch.long)
            tickets[0, 0] = taken
            into(q, k, v, *keys, 0.125, part, tickets, 0, threads)
            written = ~part.isnan()
            assert torch.equal(part[written], want[written]) and (taken == 0) == bool(written.all())
            out = torch.full_like(want, float("nan"))
            into(q, k, v, *keys, 0.125, out, tickets, 0, threads)
            assert out.isnan().all()
    with pytest.raises(RuntimeError, match="tickets must be contiguous int64"):
        into(q, k, v, *keys, 0.125, out, torch.zeros(2, 8, dtype=torch.long), 2, 2)
    with pytest.raises(RuntimeError, match="out must be contiguous float32"):
        into(q, k, v, *keys, 0.125, out[:, :64], torch.zeros(1, 8, dtype=torch.long), 0, 2)


@ISAS
def test_write_and_attend_stores_the_new_keys_then_attends_as_row_attention(isa):
    """The fused call the model makes per layer: the new tokens' keys and values (strided rows, as views of the qkv
    projection) land at their slots, and the result is row_attention's over the cache written the usual way."""
    attend = functools.partial(row_attention.row_attention, isa=isa)
    write = functools.partial(row_attention.write_and_attend, isa=isa)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(64, 2, 32, generator=g), torch.randn(64, 2, 32, generator=g)
    qkv = torch.randn(3, 8 + 2 * 2, 32, generator=g)  # 8 query heads, 2 KV heads: k_new and v_new are strided views
    q, k_new, v_new = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    new_slots = torch.tensor([40, 41, 42])
    keys = (torch.arange(43), torch.zeros(3, dtype=torch.long), torch.tensor([41, 42, 43]))
    k_ref, v_ref = k.clone().index_copy_(0, new_slots, k_new), v.clone().index_copy_(0, new_slots, v_new)
    want = attend(q, k_ref, v_ref, keys, 0.2)
    got = write(q, k_new, v_new, new_slots, k, v, keys, 0.2)
    assert torch.equal(got, want) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    with pytest.raises(RuntimeError, match="slot 64 is not in the cache"):
        write(q, k_new * 2, v_new * 2, torch.tensor([40, 41, 64]), k, v, keys, 0.2)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # a bad slot is refused before anything is written
    with pytest.raises(RuntimeError, match="k_new and v_new must be float32"):
        write(q, k_new.double(), v_new, new_slots, k, v, keys, 0.2)


@ISAS
def test_bad_keys_and_shapes_are_clear_errors(isa):
    attend = functools.partial(row_attention.row_attention, isa=isa)
    k = v = torch.zeros(10, 2, 32)
    q = torch.zeros(1, 4, 32)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="slot 10 is not in the cache"):
        attend(q, k, v, (torch.tensor([10]), one, torch.tensor([1])), 1.0)
    with pytest.raises(RuntimeError, match="row 0's keys are out of range"):
        attend(q, k, v, (torch.tensor([1]), one, torch.tensor([2])), 1.0)
    with pytest.raises(RuntimeError, match="k and v must be float32"):
        attend(q, k.half(), v.half(), (torch.tensor([1]), one, torch.tensor([1])), 1.0)
    assert not row_attention.supports(4, 2, 24) and not row_attention.supports(8, 3, 64)
    assert not row_attention.supports(4, 2, 272)
    assert row_attention.supports(9, 3, 64) and row_attention.supports(18, 1, 64)


@needs_kernel
def test_the_model_takes_the_kernel_for_batch_invariant_float32_forwards_close_to_sdpa(tiny_llama, monkeypatch):
    """The same prefill, verify and decode steps through the kernel and through the SDPA path: logits within float32
    accuracy, and the kernel's verify rows equal its decode steps bit for bit."""
    model = LlamaModel.from_hf(tiny_llama, batch_invariant=True)
    assert row_attention.supports(model.num_heads, model.num_kv_heads, model.head_size)
    ids = random_ids(46, seed=3)
    table = blocks_for(0, 46)

    def run():
        kv = model.new_kv_cache(64, BLOCK)
        model([SequenceInput(ids[:40], 0, table)], kv)
        verify = model([SequenceInput(ids[40:], 40, table, logits_rows=list(range(6)))], kv).logits
        kv = model.new_kv_cache(64, BLOCK)
        model([SequenceInput(ids[:40], 0, table)], kv)
        steps = torch.cat([model([SequenceInput([t], 40 + i, table)], kv).logits for i, t in enumerate(ids[40:])])
        return verify, steps

    calls = []
    real = row_attention.write_and_attend
    monkeypatch.setattr(row_attention, "write_and_attend", lambda *a: calls.append(1) or real(*a))
    verify, steps = run()
    assert calls and torch.equal(verify, steps)
    monkeypatch.setattr(row_attention, "kernel", lambda: None)
    calls.clear()
    sdpa_verify, sdpa_steps = run()
    assert not calls and torch.equal(sdpa_verify, sdpa_steps)
    assert torch.allclose(verify, sdpa_verify, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_a_batch_of_verifies_takes_the_kernel_and_a_long_prompt_sdpa(tiny_llama, monkeypatch):
    """Outside exact mode the kernel takes every forward whose sequences each bring at most DECODE_ROWS new tokens,
    whatever the batch (8 verifies of 3 rows: 24 rows, once SDPA's per-row calls), and a prompt longer than that
    keeps SDPA's flash kernel."""
    from pipeline.reference.model import DECODE_ROWS

    model = LlamaModel.from_hf(tiny_llama)
    assert not model.batch_invariant
    kv = model.new_kv_cache(128, BLOCK)
    prompts = [random_ids(20, seed=s) for s in range(8)]
    tables = [blocks_for(i * 2, 32) for i in range(8)]  # two blocks each
    calls = []
    real = row_attention.write_and_attend
    monkeypatch.setattr(row_attention, "write_and_attend", lambda *a: calls.append(len(a[0])) or real(*a))
    assert len(prompts[0]) - 3 > DECODE_ROWS
    for ids, table in zip(prompts, tables):
        model([SequenceInput(ids[:-3], 0, table)], kv)
    assert not calls  # prompts of 17 tokens: SDPA
    verify = model([SequenceInput(ids[-3:], 17, table, logits_rows=[0, 1, 2]) for ids, table in zip(prompts, tables)], kv)
    assert calls and set(calls) == {24} and verify.logits.shape[0] == 24
