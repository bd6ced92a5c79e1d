"""Fused layers (pipeline/reference/fused_layers.py): a model's decoder layers as one C++ call.

Dense float32 layers (a draft's) must compute what the eager layers compute (the same logits within float32 rounding,
the same KV written, so later steps agree too), on Llama and on Qwen2's biased qkv, and a DraftModelProposer running
them must propose the eager draft's tokens. Forwards the row attention kernel does not take (a prefill) keep the eager
path. int8_sq layers (a target's, switched on by the engine beside its compiled layers) must compute what the compiled
layers compute within rounding, and every row alone, bit for bit, whatever else the forward holds (tests/
test_compiled.py checks the engine's greedy and speculative tokens with them on).
"""

import pytest
import torch

from pipeline.reference import (bf16_weight_gemm, compiled, cpp_ops, fp16_weight_gemm, fused_layers, int8_grid_gemm,
                                row_attention)
from pipeline.reference.draft_model import DraftModelProposer
from pipeline.reference.engine import LLMEngine
from pipeline.reference.linear import (ONE_ROW_SPLIT_BYTES, BFloat16Weights, DenseLinear, Float16Weights,
                                        dense_linear_op, intra_op_threads)
from pipeline.reference import model as model_module
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import ProposalInput
from tests.test_compiled import assert_rows_do_not_depend_on_the_batch
from tests.test_int8_kernels import int8_engines  # noqa: F401 - the int8 engine builds, a fixture
from tests.test_model import qwen2_dir  # noqa: F401 - a fixture
from tests.test_speculative import prompts

pytestmark = pytest.mark.skipif(row_attention.kernel() is None or not cpp_ops.loaded(fused_layers.BUILD),
                                reason="the row attention or dense layers kernel does not run on this CPU")


def pair_of_models(path):
    """(eager model, fused model) of one checkpoint, each with its own KV cache."""
    eager, fused = LlamaModel.from_hf(path), LlamaModel.from_hf(path)
    caches = eager.new_kv_cache(8, 16), fused.new_kv_cache(8, 16)
    fused.fused_layers = fused_layers.build(fused)
    assert fused.fused_layers is not None
    return (eager, caches[0]), (fused, caches[1])


def run_steps(model, kv, prompt):
    """Prefill the prompt, then a 3-token chain and a 1-token step: the logits of every row of the last two."""
    model([SequenceInput(prompt, 0, list(range(8)))], kv)
    n = len(prompt)
    chain = model([SequenceInput([5, 9, 13], n, list(range(8)), logits_rows=[0, 1, 2])], kv).logits  # [3, vocab]
    step = model([SequenceInput([21], n + 3, list(range(8)))], kv).logits  # [1, vocab]: reads the chain's KV
    return torch.cat([chain, step])


@pytest.mark.parametrize("checkpoint", ["tiny_llama", "qwen2_dir"])
def test_fused_layers_compute_the_eager_layers(checkpoint, request):
    (eager, eager_kv), (fused, fused_kv) = pair_of_models(request.getfixturevalue(checkpoint))
    prompt = list(range(3, 40))  # 37 tokens: a prefill past the decode rows, on the eager path in both
    a, b = run_steps(eager, eager_kv, prompt), run_steps(fused, fused_kv, prompt)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert b.argmax(-1).tolist() == a.argmax(-1).tolist()
    torch.testing.assert_close(fused_kv.k[:, :41], eager_kv.k[:, :41], rtol=1e-5, atol=1e-5)  # 37 + 3 + 1 slots, as written
    torch.testing.assert_close(fused_kv.v[:, :41], eager_kv.v[:, :41], rtol=1e-5, atol=1e-5)


def test_a_prefill_keeps_the_eager_layers(tiny_llama):
    (eager, eager_kv), (fused, fused_kv) = pair_of_models(tiny_llama)
    prompt = list(range(3, 40))
    seq = SequenceInput(prompt, 0, list(range(8)), logits_rows=list(range(len(prompt))))
    assert torch.equal(fused([seq], fused_kv).logits, eager([seq], eager_kv).logits)  # bit for bit: no fused call


def test_the_draft_proposer_runs_fused_layers_and_proposes_the_eager_tokens(tiny_llama, monkeypatch):
    def propose(env):
        monkeypatch.setenv(fused_layers.ENV, env)
        proposer = DraftModelProposer(LlamaModel.from_hf(tiny_llama), max_batch_size=2, max_seq_len=128)
        inputs = [ProposalInput("a", list(range(3, 30)), 5), ProposalInput("b", list(range(40, 52)), 3)]
        first = proposer.propose(inputs)
        inputs[0].token_ids += first[0].token_ids[:2] + [7]  # two accepted, then a correction
        return proposer.model.fused_layers, [d.token_ids for d in first + proposer.propose(inputs[:1])]

    fused, fused_tokens = propose("1")
    eager, eager_tokens = propose("0")
    assert fused is not None and eager is None
    assert fused_tokens == eager_tokens and [len(t) for t in fused_tokens] == [5, 3, 5]


def draft_rounds(proposer, inputs):
    """Two propose calls: drafts for every input, then, for each request, its first drafts partly accepted (half of
    them, then a correction) and drafts again. -> (token lists of both calls, each request's cached tokens)."""
    first = proposer.propose(inputs)
    for inp, draft in zip(inputs, first):
        inp.token_ids = inp.token_ids + draft.token_ids[:len(draft.token_ids) // 2] + [5]
    second = proposer.propose(inputs)
    return [d.token_ids for d in first + second], {i.request_id: proposer.sequences[i.request_id].cached for i in inputs}


def test_greedy_chains_draft_what_forward_by_forward_drafting_drafts(tiny_llama):
    """One op call per propose (a prompt-long feed included) against a forward per draft token (the prompt on the
    prefill path): the same tokens, the same cached tokens, the same KV."""
    def run(chains: bool):
        proposer = DraftModelProposer(LlamaModel.from_hf(tiny_llama), max_batch_size=3, max_seq_len=128)
        assert proposer.greedy_chains
        proposer.greedy_chains = chains
        inputs = [ProposalInput("long", list(range(3, 40)), 6), ProposalInput("short", list(range(50, 60)), 3),
                  ProposalInput("one", list(range(70, 75)), 1)]
        return (*draft_rounds(proposer, inputs), proposer)

    chain_tokens, chain_cached, chained = run(True)
    loop_tokens, loop_cached, looped = run(False)
    assert chain_tokens == loop_tokens and [len(t) for t in chain_tokens] == [6, 3, 1, 6, 3, 1]
    assert chain_cached == loop_cached
    size = chained.kv.block_size
    for request_id, cached in chain_cached.items():
        blocks = chained.sequences[request_id].blocks.blocks
        assert blocks == looped.sequences[request_id].blocks.blocks
        slots = [b * size + o for b in blocks for o in range(size)][:len(cached)]  # the cached tokens' KV
        torch.testing.assert_close(chained.kv.k[:, slots], looped.kv.k[:, slots], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chained.kv.v[:, slots], looped.kv.v[:, slots], rtol=1e-5, atol=1e-5)


HALF_HEADS = [pytest.param(BFloat16Weights, bf16_weight_gemm, marks=pytest.mark.skipif(
                  bf16_weight_gemm.kernel() is None, reason="no AVX512-BF16 on this CPU")),
              pytest.param(Float16Weights, fp16_weight_gemm, marks=pytest.mark.skipif(
                  fp16_weight_gemm.kernel() is None, reason="no AVX2 on this CPU"))]


@pytest.mark.parametrize("layer, kernel", HALF_HEADS)
@pytest.mark.parametrize("chains", [True, False])
def test_a_draft_proposes_from_its_16_bit_output_layer_and_a_target_keeps_float32(tiny_llama, chains, layer, kernel,
                                                                                 monkeypatch):
    """A model given to DraftModelProposer runs its output layer on 16-bit weights (its logits only propose): the bf16
    kernel where it runs, else the fp16 kernel (AVX2 hosts), in the one-call chains and forward by forward alike; a
    model that is not a draft keeps DenseLinear. The draft's 16-bit weights are swapped for ones that leave two
    tokens a logit each (opposite signs, the rest 0): every proposal is one of the two, which the float32 weights
    would not give."""
    if layer is Float16Weights:
        monkeypatch.setattr(bf16_weight_gemm, "kernel", lambda: None)  # a host without AVX512-BF16
    target, draft = LlamaModel.from_hf(tiny_llama), LlamaModel.from_hf(tiny_llama)
    proposer = DraftModelProposer(draft, max_batch_size=1, max_seq_len=128)
    proposer.greedy_chains = chains
    assert isinstance(draft.lm_head_linear, layer) and isinstance(target.lm_head_linear, DenseLinear)
    assert draft.fused_layers.lm_head is draft.lm_head_linear  # the chains run it too
    two_tokens = torch.zeros_like(draft.lm_head)
    two_tokens[5], two_tokens[9] = draft.lm_head[7], -draft.lm_head[7]
    draft.lm_head_linear.kernel.packed = kernel.pack(two_tokens)
    tokens = proposer.propose([ProposalInput("r", list(range(3, 20)), 4)])[0].token_ids
    assert len(tokens) == 4 and set(tokens) <= {5, 9}


def test_sampled_requests_draft_beside_greedy_chains(tiny_llama):
    proposer = DraftModelProposer(LlamaModel.from_hf(tiny_llama), max_batch_size=2, max_seq_len=128)
    alone = proposer.propose([ProposalInput("g", list(range(3, 12)), 4)])[0].token_ids
    proposer.release("g")
    sampled = ProposalInput("s", list(range(20, 30)), 3, temperature=0.8, generator=torch.Generator().manual_seed(0))
    greedy, drafted = proposer.propose([ProposalInput("g", list(range(3, 12)), 4), sampled])
    assert greedy.token_ids == alone and greedy.probs is None
    assert len(drafted.token_ids) == 3 and drafted.probs.shape == (3, proposer.model.vocab_size)
    torch.testing.assert_close(drafted.probs.sum(-1), torch.ones(3))


def test_greedy_chains_refuse_blocks_too_few_for_the_chain(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama)
    layers = fused_layers.build(model)
    kv = model.new_kv_cache(4, 16)
    with pytest.raises(RuntimeError, match="blocks hold fewer than its cached"):
        layers.greedy_chains([[3, 4]], [14], [2], [[0]], kv)  # positions 14..16: the third needs a second block


def test_one_row_gemvs_split_over_the_threads_keep_f_linears_bits_on_one_thread():
    """`dense_linear` splits a one-row GEMV's output channels over the threads, each part MKL's GEMV: the result is
    F.linear's on one thread on the same weight, bit for bit, in the wide and the usual layout, with and without a
    bias, for parts of any size (split_min_bytes 0 splits every weight; 5 and 300 channels are no multiple of 16) and
    under inference mode (a forward's: its threads must carry it). F.linear on two threads is not the reference: on
    an Intel AMX host MKL's threaded GEMV summed the 300 x 1000 weight's rows differently (last bits)."""
    torch.manual_seed(0)
    split = dense_linear_op()
    assert split is not None
    for out_features, in_features in ((4096, 128), (300, 1000), (5, 64)):
        weight = torch.randn(out_features, in_features)
        for bias in (None, torch.randn(out_features)):
            linear = DenseLinear(weight, bias)  # wide layout where out > in
            x = torch.randn(1, in_features)
            with intra_op_threads(2), torch.inference_mode():
                parts = split(x, linear.weight, bias, 0)
                called = linear(x)
            with intra_op_threads(1):
                expected = torch.nn.functional.linear(x, linear.weight, bias)
            assert torch.equal(parts, expected) and torch.equal(called, expected)
            assert linear.split_one_row == (out_features * in_features * 4 >= ONE_ROW_SPLIT_BYTES)


def test_models_it_cannot_run_stay_eager(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama, dtype="bfloat16")
    assert "float32" in fused_layers.eligible(model)
    assert fused_layers.build(model) is None


def test_an_int8_kv_cache_keeps_the_eager_layers(tiny_llama):
    (eager, _), (fused, _) = pair_of_models(tiny_llama)
    caches = [m.new_kv_cache(8, 16, "INT8") for m in (eager, fused)]
    a, b = (run_steps(m, kv, list(range(3, 40))) for m, kv in zip((eager, fused), caches))
    assert torch.equal(b, a)


def test_the_op_names_a_wrong_weight_count(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama)
    kv = model.new_kv_cache(4, 16)
    layers = fused_layers.FusedDenseLayers(model)
    layers.weights = layers.weights[:-1]
    model.fused_layers = layers
    with pytest.raises(RuntimeError, match="7 weights per layer"):
        model([SequenceInput([3], 0, [0])], kv)


needs_int8_kernel = pytest.mark.skipif(int8_grid_gemm.kernel() is None, reason="no int8 kernel runs on this CPU")


def int8_sq_model(engine_dir, fused: bool):
    """The int8_sq engine's model in exact mode (every forward on the row attention kernel) with its compiled layers,
    and its fused layers too when `fused`."""
    model = LlamaModel.from_engine_dir(engine_dir, batch_invariant=True)
    model.compiled_layers = compiled.CompiledLayers(model)
    model.fused_layers = fused_layers.build(model) if fused else None
    assert fused == isinstance(model.fused_layers, fused_layers.FusedInt8Layers)
    return model, model.new_kv_cache(8, 16)


@needs_int8_kernel
def test_int8_sq_fused_layers_compute_the_compiled_layers(int8_engines):  # noqa: F811 - the imported fixture
    (compiled_model, compiled_kv), (fused_model, fused_kv) = (int8_sq_model(int8_engines["int8_sq"], f) for f in (False, True))
    prompt = prompts(1)[0] * 3  # a prefill of 16 + tokens, then a 3-token chain and a step
    a, b = run_steps(compiled_model, compiled_kv, prompt), run_steps(fused_model, fused_kv, prompt)
    assert not torch.equal(b, a)  # a different computation (its own sums), not the compiled layers called again
    torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
    assert b.argmax(-1).tolist() == a.argmax(-1).tolist()
    n = len(prompt) + 4
    torch.testing.assert_close(fused_kv.k[:, :n], compiled_kv.k[:, :n], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fused_kv.v[:, :n], compiled_kv.v[:, :n], rtol=1e-3, atol=1e-3)


@needs_int8_kernel
def test_int8_sq_chains_build_the_plan_the_python_plan_builds(int8_engines):  # noqa: F811 - the imported fixture
    """FusedInt8Layers.chains (the row attention's plan, embeddings and RoPE rows made in the op) computes what the
    layers op computes on model._AttentionPlan.for_row_attention's plan: the same bits in every row and cache slot,
    for sequences on scattered blocks with prefills, a chain and a decode step in one forward."""
    model, kv = int8_sq_model(int8_engines["int8_sq"], fused=True)
    kv.k.zero_(), kv.v.zero_()  # not torch.empty's leftovers (a NaN among them is unequal to itself)
    a, b = prompts(2)
    tables = [[5, 2, 7], [1, 6, 3]]  # 16-token blocks, out of order
    model([SequenceInput(a * 3, 0, tables[0]), SequenceInput(b, 0, tables[1])], kv)
    old_kv = model.new_kv_cache(8, 16)
    old_kv.k.copy_(kv.k), old_kv.v.copy_(kv.v)
    seqs = [SequenceInput([5, 9, 13], 3 * len(a), tables[0], logits_rows=[0, 2]),  # a chain across two blocks
            SequenceInput([21], len(b), tables[1]), SequenceInput(b[:7], 0, [4])]  # a decode step, a prefill
    new = model(seqs, kv, return_hidden=True)
    plan = model_module._AttentionPlan.for_row_attention(seqs, kv.block_size)
    positions = torch.tensor(plan.positions)
    layers = model.fused_layers
    with intra_op_threads(model.decode_threads):
        hidden = torch.ops.specdeploy.int8_sq_layers(
            model.embed[plan.token_ids], model.rope_cos[positions].unsqueeze(1),
            model.rope_signed_sin[positions].unsqueeze(1), layers.weights, old_kv.k, old_kv.v, plan.slots,
            *plan.row_keys, model.final_norm, model.num_heads, model.num_kv_heads, model.eps, model.scale,
            layers.attention, *layers.gemm)
    assert new.hidden_states.shape == (11, model.hidden_size) and torch.equal(new.hidden_states, hidden)
    assert torch.equal(new.logits, model._logits(hidden, plan.logits_index)) and new.logits.shape[0] == 4
    assert torch.equal(kv.k, old_kv.k) and torch.equal(kv.v, old_kv.v)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model([SequenceInput([3], model.rope_cos.shape[0], [0] * (model.rope_cos.shape[0] // 16 + 1))], kv)
    with pytest.raises(ValueError, match="block table holds 16 tokens"):
        model([SequenceInput([3] * 17, 0, [0])], kv)


@pytest.mark.skipif(int8_grid_gemm.kernel() is not int8_grid_gemm.VNNI or not int8_grid_gemm.AVX2.cpu_supported()
                    or not cpp_ops.loaded(int8_grid_gemm.AVX2), reason="needs both int8 GEMM builds (a VNNI CPU)")
def test_int8_sq_fused_layers_give_the_same_bits_on_the_avx2_gemm(int8_engines, monkeypatch):  # noqa: F811
    """The op calls whichever int8 GEMM build the model's weights are packed for; both builds return the same bits."""
    prompt = prompts(1)[0] * 3
    vnni = run_steps(*int8_sq_model(int8_engines["int8_sq"], fused=True), prompt)
    monkeypatch.setattr(int8_grid_gemm, "kernel", lambda: int8_grid_gemm.AVX2)  # weights packed for the AVX2 build
    model, kv = int8_sq_model(int8_engines["int8_sq"], fused=True)
    assert model.fused_layers.gemm[0] == "specdeploy::int8_grid_gemm_avx2_into"
    assert torch.equal(run_steps(model, kv, prompt), vnni)


@needs_int8_kernel
def test_int8_sq_fused_layers_give_the_same_bits_on_one_thread_two_and_three(int8_engines):  # noqa: F811
    """A forward's work is split over a team of threads (rows, output channels, attention items): no bit may depend on
    that (the engine picks its decode threads by speed alone, decode_threads.choose)."""
    prompt = prompts(1)[0] * 3
    outs = []
    for threads in (1, 2, 3):
        model, kv = int8_sq_model(int8_engines["int8_sq"], fused=True)
        model.decode_threads = threads  # the threads of every forward in exact mode
        with intra_op_threads(threads):
            outs.append(run_steps(model, kv, prompt))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_int8_kernel
def test_a_failure_on_a_forwards_team_is_raised_and_the_next_forward_runs(int8_engines):  # noqa: F811
    """An op that fails inside the team (here the attention, on a key slot past the cache) releases the threads that
    wait for it: the caller gets the error, not a hang, and the model's next forward computes as before."""
    model, kv = int8_sq_model(int8_engines["int8_sq"], fused=True)
    layers, slots = model.fused_layers, kv.k.shape[1]
    x, cos, sin = model.embed[[3]], model.rope_cos[[0]].unsqueeze(1), model.rope_signed_sin[[0]].unsqueeze(1)
    keys = (torch.tensor([slots]), torch.tensor([0]), torch.tensor([1]))
    with intra_op_threads(2), pytest.raises(RuntimeError, match=f"slot {slots} is not in the cache"):
        torch.ops.specdeploy.int8_sq_layers(x, cos, sin, layers.weights, kv.k, kv.v, torch.tensor([0]), *keys,
                                            model.final_norm, model.num_heads, model.num_kv_heads, model.eps,
                                            model.scale, layers.attention, *layers.gemm)
    model.decode_threads = 2
    prompt = prompts(1)[0] * 3
    with intra_op_threads(2):
        assert torch.equal(run_steps(model, kv, prompt), run_steps(*int8_sq_model(int8_engines["int8_sq"], fused=True),
                                                                   prompt))


@needs_int8_kernel
def test_a_prompt_outside_exact_mode_runs_on_the_fused_int8_layers(int8_engines):  # noqa: F811
    """Outside exact mode a prompt (more than DECODE_ROWS tokens) runs on the fused layers too, on torch's threads
    (a prefill there 0.70-0.90x the time of the compiled regions with SDPA): the bits of exact mode's prefill."""
    exact, exact_kv = int8_sq_model(int8_engines["int8_sq"], fused=True)
    loose, loose_kv = int8_sq_model(int8_engines["int8_sq"], fused=True)
    loose.batch_invariant = False
    prompt = prompts(1)[0] * 3
    assert len(prompt) > model_module.DECODE_ROWS
    seq = SequenceInput(prompt, 0, [0, 1, 2, 3], logits_rows=list(range(len(prompt))))
    with intra_op_threads(2):
        got = loose([seq], loose_kv).logits
    assert torch.equal(got, exact([seq], exact_kv).logits)
    assert torch.equal(loose_kv.k[:, :len(prompt)], exact_kv.k[:, :len(prompt)])


@needs_int8_kernel
def test_int8_sq_fused_rows_do_not_depend_on_the_batch(int8_engines):  # noqa: F811
    model, _ = int8_sq_model(int8_engines["int8_sq"], fused=True)
    assert_rows_do_not_depend_on_the_batch(model)


@needs_int8_kernel
def test_the_engine_runs_an_int8_sq_target_on_fused_layers_beside_its_compiled_ones(int8_engines, monkeypatch):  # noqa: F811
    def engine_model(**overrides):
        return LLMEngine.from_engine_dir(int8_engines["int8_sq"], max_batch_size=2, max_seq_len=128, max_input_len=64,
                                         **overrides).model

    # every forward on the fused layers, prompts too, in exact mode (as served) and outside it: no regions compiled
    # (seconds of a server's start); the decode thread count is a matter of speed, as with the regions
    for exact in (True, False):
        model = engine_model(compiled_layers=True, batch_invariant=exact)
        assert isinstance(model.fused_layers, fused_layers.FusedInt8Layers) and model.compiled_layers is None
        assert model.thread_count_invariant(model.new_kv_cache(2, 32))
    assert engine_model(compiled_layers=False).fused_layers is None  # eager layers, as the suite runs them
    # ... but a forward over an INT8 KV cache is off the row attention kernel: the regions run it
    assert engine_model(compiled_layers=True, batch_invariant=True, kv_cache_quant_algo="INT8").compiled_layers is not None
    monkeypatch.setenv(fused_layers.ENV, "0")
    model = engine_model(compiled_layers=True)
    assert model.compiled_layers is not None and model.fused_layers is None
