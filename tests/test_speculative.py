"""Speculative decoding through the engine (fp32, batch-invariant math): every proposer gives exactly
the plain greedy tokens, at batch 1 and with 8 requests of different lengths joining at different
steps; acceptance behaves as the pair says (exact pair ~100 %, derived pair partial, weak pair ~0).
Plus a chi-square test that sampled speculative outputs of a real (tiny) model follow its distribution.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.reference.draft_model import DraftModelProposer
from pipeline.reference.eagle import EagleProposer
from pipeline.reference.engine import EngineConfig, LLMEngine, Request, SamplingParams
from pipeline.reference.medusa import MedusaProposer, load_medusa_dir
from pipeline.spec_stats import aggregate
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.policy import PolicyConfig, PolicyProposer
from pipeline.fixtures.models import make_random_eagle3
from pipeline.fixtures.toymodels import make_derived_pair
from pipeline.reference.proposers import Draft, NgramProposer, ProposalInput
from pipeline.reference.step_cost import STEPS_PER_RUN, WARMUP_STEPS, draft_token_cost, in_engine_draft_token_cost
from pipeline.apps.bench_engine import UnsharedDrafts

MAX_NEW = 12
MEDUSA_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
EAGLE3_LAYERS = (0, 1, 2)  # the 4-layer test targets are too shallow for TensorRT-LLM's default (1, L//2-1, L-4)


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    """n prompts of different lengths (4..25 tokens), each with a repeated stretch for prompt lookup."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        head = torch.randint(3, 512, (4 + 3 * i,), generator=g).tolist()
        out.append(head + head[: 2 + i % 3])
    return out


def run(target_dir, proposer=None, requests=None, stagger: bool = False, max_draft_len: int = 8, sampling=None):
    """Generate with a fresh engine; returns ({request_id: tokens}, aggregated SpecStats)."""
    model = LlamaModel.from_hf(target_dir, "float32")
    engine = LLMEngine(model, EngineConfig(max_batch_size=8, max_draft_len=max_draft_len, batch_invariant=True,
                                           max_seq_len=256, max_input_len=128), proposer)
    requests = list(requests if requests is not None else enumerate(prompts()))
    tokens, stats = drive(engine, requests, stagger, sampling)
    return tokens, aggregate(stats)


def drive(engine, requests, stagger: bool = False, sampling=None) -> tuple[dict[str, list[int]], list]:
    """Run (index, prompt) requests of MAX_NEW tokens to the end: ({request_id: tokens}, finished requests' stats).
    Staggered: one request joins per step; else everybody at once."""
    tokens: dict[str, list[int]] = {}
    stats = []
    pending = [Request(f"r{i}", p, MAX_NEW, sampling=sampling or SamplingParams()) for i, p in requests]
    while pending or engine.has_unfinished():
        if pending:
            for req in pending[:1] if stagger else pending:
                engine.add_request(req)
            pending = pending[1:] if stagger else []
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                stats.append(out.stats)
    return tokens, stats


@pytest.fixture(scope="module")
def plain(derived_pair):
    """Plain greedy tokens of every prompt, each request alone (batch 1)."""
    target, _ = derived_pair
    return {f"r{i}": run(target, requests=[(i, p)])[0][f"r{i}"] for i, p in enumerate(prompts())}


def random_medusa_dir(path, hidden=64, vocab=512, num_heads=3, seed=0):
    """A tiny FasterDecoding-format Medusa folder with random heads (one ResBlock + own LM head each)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for h in range(num_heads):
        state[f"{h}.0.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        state[f"{h}.0.linear.bias"] = torch.zeros(hidden)
        state[f"{h}.1.weight"] = torch.randn(vocab, hidden, generator=g) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, path / "medusa_lm_head.safetensors")
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": 1}))
    return path


def random_eagle_dir(path, hidden=64, vocab=512, heads=4, kv_heads=2, inter=128, seed=0):
    """A tiny EAGLE-1 folder (config.json + model.safetensors) with random weights."""
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads

    def r(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    state = {"fc.weight": r(hidden, 2 * hidden), "fc.bias": torch.zeros(hidden),
             "layers.0.self_attn.q_proj.weight": r(heads * d, hidden), "layers.0.self_attn.k_proj.weight": r(kv_heads * d, hidden),
             "layers.0.self_attn.v_proj.weight": r(kv_heads * d, hidden), "layers.0.self_attn.o_proj.weight": r(hidden, heads * d),
             "layers.0.mlp.gate_proj.weight": r(inter, hidden), "layers.0.mlp.up_proj.weight": r(inter, hidden),
             "layers.0.mlp.down_proj.weight": r(hidden, inter), "layers.0.post_attention_layernorm.weight": torch.ones(hidden)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, path / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
              "vocab_size": vocab, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    return path


class ScriptedTreeProposer:
    """Test proposer: a tree whose SECOND branch holds the true continuation (from a plain run), the first a wrong one.

    Exercises tree verification through the engine with accepted paths off the first branch, so the
    accepted KV must be moved next to the root.
    """

    needs_hidden_states = False

    def __init__(self, plain_tokens: dict[str, list[int]], prompt_lens: dict[str, int]):
        self.plain, self.prompt_lens = plain_tokens, prompt_lens

    def propose(self, inputs):
        drafts = []
        for inp in inputs:
            done = len(inp.token_ids) - self.prompt_lens[inp.request_id]
            truth = self.plain[inp.request_id][done:done + 3]
            if len(truth) < 3 or inp.num_tokens < 6:
                drafts.append(Draft(token_ids=[]))
                continue
            wrong = [(t + 1) % 512 for t in truth]
            # nodes: 0 wrong0, 1 truth0, 2 wrong1 (under 0), 3 wrong1 (under 1), 4 truth1 (under 1), 5 truth2 (under 4)
            drafts.append(Draft(token_ids=[wrong[0], truth[0], wrong[1], wrong[1], truth[1], truth[2]],
                                parents=[-1, -1, 0, 1, 1, 4]))
        return drafts

    def update(self, request_id, num_accepted, num_proposed):
        pass

    def release(self, request_id):
        pass


def make_proposer(kind, pair_dir, tmp_path):
    target, draft = pair_dir
    target_model = LlamaModel.from_hf(target, "float32")
    if kind == "ngram":
        return NgramProposer(1, 3)
    if kind == "draft":
        return DraftModelProposer.from_hf(draft, max_seq_len=256)
    if kind == "medusa":
        return MedusaProposer(load_medusa_dir(random_medusa_dir(tmp_path / "medusa"), target_model.lm_head), MEDUSA_CHOICES)
    if kind == "eagle":
        return EagleProposer.from_eagle_dir(random_eagle_dir(tmp_path / "eagle"), target_model, choices=MEDUSA_CHOICES)
    if kind == "eagle2":
        return EagleProposer.from_eagle_dir(random_eagle_dir(tmp_path / "eagle"), target_model, dynamic_top_k=3)
    if kind == "eagle3":  # a draft vocabulary of 256 of the 512 target tokens (d2t / t2d maps)
        heads = make_random_eagle3(target, tmp_path / "eagle3", dtype="float32", draft_vocab_size=256)
        return EagleProposer.from_eagle_dir(heads, target_model, choices=MEDUSA_CHOICES, layers_to_capture=EAGLE3_LAYERS)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["ngram", "draft", "medusa", "eagle", "eagle2", "eagle3"])
def test_greedy_speculation_equals_plain_decoding(kind, derived_pair, plain, tmp_path):
    target, _ = derived_pair
    alone = {}
    for i, p in enumerate(prompts()[:1]):  # batch 1
        alone.update(run(target, make_proposer(kind, derived_pair, tmp_path), requests=[(i, p)])[0])
    assert alone == {k: plain[k] for k in alone}
    batched, stats = run(target, make_proposer(kind, derived_pair, tmp_path), stagger=True)  # 8 joining at different steps
    assert batched == plain
    assert stats.draft_tokens > 0  # speculation really happened


def test_draft_model_acceptance_follows_the_pair(derived_pair, exact_pair, tmp_path):
    target, draft = exact_pair
    _, exact = run(target, DraftModelProposer.from_hf(draft, max_seq_len=256))
    assert exact.acceptance_rate > 0.97  # the draft is the target: every draft token is accepted (bonus path)
    target, draft = derived_pair
    _, partial = run(target, DraftModelProposer.from_hf(draft, max_seq_len=256), max_draft_len=4)
    assert 0.2 < partial.acceptance_by_position[0] < 0.95  # accepted prefixes and recovered tokens
    assert 0 < partial.accepted_tokens < partial.draft_tokens
    assert partial.acceptance_by_position[0] > partial.acceptance_by_position[-1]
    weak_target, weak_draft = make_derived_pair(tmp_path / "weak", eps=1.0)
    weak_plain, _ = run(weak_target)
    weak_tokens, weak = run(weak_target, DraftModelProposer.from_hf(weak_draft, max_seq_len=256))
    assert weak_tokens == weak_plain and weak.acceptance_rate < 0.1  # all-reject path


def test_tree_paths_off_the_first_branch_are_compacted_correctly(derived_pair, plain):
    target, _ = derived_pair
    lens = {f"r{i}": len(p) for i, p in enumerate(prompts())}
    tokens, stats = run(target, ScriptedTreeProposer(plain, lens), stagger=True)
    assert tokens == plain
    assert stats.accepted_tokens > 0 and stats.mean_accepted_length > 2  # truth0, truth1, truth2 accepted


def test_policy_switches_off_a_useless_draft_and_keeps_the_output(derived_pair, plain, tmp_path):
    target, _ = derived_pair
    _, unrelated_draft = make_derived_pair(tmp_path / "unrelated", seed=5)  # another random model: ~0 % acceptance
    policy = PolicyProposer(DraftModelProposer.from_hf(unrelated_draft, max_seq_len=256),
                            PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.3, window=3))
    tokens, stats = run(target, policy)
    assert tokens == plain
    assert stats.spec_steps <= 3 * 8  # every request stopped speculating after its window


def test_cost_aware_switch_off_stops_a_draft_below_break_even_and_keeps_the_output(derived_pair, plain):
    target, draft = derived_pair  # ~58 % acceptance: above the 10 % floor, below a 90 % break-even

    def policy(cost):
        return PolicyProposer(DraftModelProposer.from_hf(draft, max_seq_len=256),
                              PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=3,
                                           draft_token_costs=((1, cost),)))
    tokens, costly = run(target, policy(0.9))
    assert tokens == plain
    assert 0 < costly.spec_steps <= 3 * 8  # every request stopped after its window
    tokens, free = run(target, policy(0.0))
    assert tokens == plain and free.spec_steps > 3 * 8  # with free draft tokens the same draft keeps going


def test_drafts_made_one_request_at_a_time_equal_the_shared_draft_step(derived_pair, plain):
    target, draft = derived_pair
    shared_tokens, shared = run(target, DraftModelProposer.from_hf(draft, max_seq_len=256), stagger=True)
    alone_tokens, alone = run(target, UnsharedDrafts(DraftModelProposer.from_hf(draft, max_seq_len=256)), stagger=True)
    assert shared_tokens == alone_tokens == plain
    assert shared.summary() == alone.summary()  # the same drafts: batching the draft forward changes only its cost


def test_draft_token_cost_is_measured_per_draft_token(derived_pair):
    target_dir, draft_dir = derived_pair
    target, draft = LlamaModel.from_hf(target_dir), LlamaModel.from_hf(draft_dir)
    for costs in (draft_token_cost(target, draft, (2, 1), context=64, repeats=2),
                  draft_token_cost(target, None, (2, 1), context=64, repeats=2)):
        assert len(costs) == 2 and all(0.0 <= cost < float("inf") for cost in costs)  # one per K, in the given order
    with pytest.raises(ValueError, match="k must be >= 1"):
        draft_token_cost(target, draft, (2, 0))


def test_in_engine_draft_token_cost_times_speculative_steps_of_every_request(derived_pair):
    """Each K's proposer drafts K tokens for each prompt's request on every timed step, after every prompt; nobody
    finishes early; one cost per K, in the given order."""
    target_dir, draft_dir = derived_pair
    target = LlamaModel.from_hf(target_dir)
    ks, batch, context, repeats = (3, 1), 2, 40, 4
    proposers = []

    def make_proposer():
        proposer = DraftModelProposer(LlamaModel.from_hf(draft_dir), max_batch_size=batch,
                                      max_seq_len=context + (repeats * STEPS_PER_RUN + WARMUP_STEPS) * (max(ks) + 1)
                                      + max(ks) + 1)
        proposer.asked, propose = [], proposer.propose
        proposer.propose = lambda inputs: proposer.asked.append([i.num_tokens for i in inputs]) or propose(inputs)
        proposers.append(proposer)
        return proposer

    prompts = torch.randint(target.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0)).tolist()
    costs = in_engine_draft_token_cost(target, make_proposer, ks, prompts, repeats=repeats)
    assert len(costs) == len(ks) and all(0.0 <= cost < float("inf") for cost in costs)
    for proposer, k in zip(proposers, ks):
        assert proposer.asked[-repeats * STEPS_PER_RUN:] == [[k] * batch] * (repeats * STEPS_PER_RUN)
        assert all(seq.cached[:context] == prompt for seq, prompt in zip(proposer.sequences.values(), prompts))
        assert len(proposer.sequences) == batch
    with pytest.raises(ValueError, match="prompts is empty"):
        in_engine_draft_token_cost(target, make_proposer, ks, [])


def next_token_law(model: LlamaModel, context: list[int], temperature: float) -> torch.Tensor:
    """The model's sampling distribution [vocab] after `context` (a fresh forward)."""
    logits = model([SequenceInput(context, 0, list(range(8)))], model.new_kv_cache(8, 32)).logits[0]
    return torch.softmax(logits / temperature, dim=-1)


def test_sampled_speculation_follows_the_target_distribution(derived_pair):
    """1200 sampled requests through the engine with a draft model (lossless rejection sampling).

    Token 1 comes from the prefill; tokens 2 and 3 from speculative steps. Given the most frequent
    token 1 = a, the joint law of (token 2, token 3) must be p(b | prompt a) * p(c | prompt a b):
    chi-square at alpha = 1e-3, fixed seeds. The same check must reject the draft's own law.
    """
    from tests.test_rejection_sampler import ALPHA, chi_square_pvalue

    target, draft = derived_pair
    model, draft_model = LlamaModel.from_hf(target, "float32"), LlamaModel.from_hf(draft, "float32")
    prompt, temperature, n = prompts(1, seed=3)[0], 3.0, 1200  # temperature 3 spreads the x8-sharpened logits
    engine = LLMEngine(model, EngineConfig(max_batch_size=8, max_draft_len=4, max_seq_len=256, max_input_len=128),
                       DraftModelProposer(draft_model, max_seq_len=256))
    outputs: dict[str, list[int]] = {}
    for i in range(n):
        engine.add_request(Request(f"s{i}", prompt, 3, SamplingParams(temperature=temperature, seed=1000 + i),
                                   num_draft_tokens=3))
        while len(engine.waiting) + len(engine.running) >= 8 or (i == n - 1 and engine.has_unfinished()):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats.spec.draft_tokens > 0
    a = max(set(o[0] for o in outputs.values()), key=lambda t: sum(o[0] == t for o in outputs.values()))
    pairs = torch.tensor([o[1] * 512 + o[2] for o in outputs.values() if o[0] == a])

    def joint_law(m: LlamaModel) -> torch.Tensor:
        second = next_token_law(m, prompt + [a], temperature)  # [vocab]
        joint = torch.zeros(512, 512)
        for b in second.topk(40).indices.tolist():  # the rest carries < 1e-3 of the mass: pooled as zero
            joint[b] = second[b] * next_token_law(m, prompt + [a, b], temperature)
        return joint.flatten() / joint.sum()

    counts = torch.bincount(pairs, minlength=512 * 512)
    assert chi_square_pvalue(counts, joint_law(model)) > ALPHA
    assert chi_square_pvalue(counts, joint_law(draft_model)) < ALPHA


def test_engine_stored_heads_propose_like_their_source_folders(tiny_llama, tmp_path):
    """Medusa / EAGLE weights as convert.py stores them in an engine (prefixed keys + pretrained_config)
    give the same drafts as the FasterDecoding / SafeAILab folders."""

    from pipeline.reference.proposers import ProposalInput
    from pipeline.reference.speculation import engine_proposer

    target = LlamaModel.from_hf(tiny_llama, "float32")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 64, generator=g)
    inp = [ProposalInput("a", [7, 8, 9, 10, 11, 12], 6, hidden_states=hidden)]

    medusa_dir = random_medusa_dir(tmp_path / "medusa")
    folder = load_file(medusa_dir / "medusa_lm_head.safetensors")
    state = {f"medusa_heads.{k.split('.')[0]}." + (".".join(k.split(".")[1:]) if "linear" in k else "lm_head.weight"): v
             for k, v in folder.items()}
    config = {"medusa": {"num_medusa_heads": 3, "num_medusa_layers": 1, "max_draft_len": 8}}
    from_engine = engine_proposer(config, state, target, choices=MEDUSA_CHOICES).propose(inp)
    from_folder = MedusaProposer(load_medusa_dir(medusa_dir, target.lm_head), MEDUSA_CHOICES).propose(inp)
    assert from_engine == from_folder and len(from_engine[0].token_ids) == 6

    eagle_dir = random_eagle_dir(tmp_path / "eagle")
    state = {f"eagle.{k}": v for k, v in load_file(eagle_dir / "model.safetensors").items()}
    net = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_size": 16,
           "intermediate_size": 128, "num_hidden_layers": 1, "norm_epsilon": 1e-5}
    config = {"eagle": {"version": 2, "num_eagle_layers": 3, "max_draft_len": 8, "max_non_leaves_per_layer": 4, **net}}
    from_engine = engine_proposer(config, state, target, dynamic_top_k=2).propose(inp)
    from_folder = EagleProposer.from_eagle_dir(eagle_dir, target, dynamic_top_k=2).propose(inp)
    assert from_engine[0].token_ids == from_folder[0].token_ids and from_engine[0].parents == from_folder[0].parents

    heads = make_random_eagle3(tiny_llama, tmp_path / "eagle3", dtype="float32", draft_vocab_size=256)
    state = {f"eagle.{k}": v for k, v in load_file(heads / "model.safetensors").items()}
    config = {"eagle": {"version": 3, "num_eagle_layers": 3, "max_draft_len": 8, "max_non_leaves_per_layer": 4, **net,
                        "draft_vocab_size": 256, "layers_to_capture": [0, 1, 2]}}
    inp3 = [ProposalInput("a", [7, 8, 9, 10, 11, 12], 6, hidden_states=torch.randn(5, 3 * 64, generator=g))]
    from_engine = engine_proposer(config, state, target, choices=MEDUSA_CHOICES).propose(inp3)
    from_folder = EagleProposer.from_eagle_dir(heads, target, choices=MEDUSA_CHOICES, layers_to_capture=(0, 1, 2)).propose(inp3)
    assert from_engine == from_folder and len(from_engine[0].token_ids) == 6
    assert engine_proposer({"medusa": None, "eagle": None}, {}, target) is None


def dense_eagle3_top_k(heads, target_dir, tokens: list[int], layers, k: int) -> list[int]:
    """Target ids of the k most likely EAGLE-3 drafts after tokens, read densely from the public format (SafeAILab
    cnets.py: fc over the captured layers, midlayer over concat(input_layernorm(emb), hidden_norm(g)) with g as
    residual, lm_head(norm(.)), d2t) with transformers' hidden states: no cache, no tree, no engine."""
    from transformers import LlamaForCausalLM

    w, cfg = load_file(heads / "model.safetensors"), json.loads((heads / "config.json").read_text())
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        # hidden_states[i + 1] is layer i's output (the last entry is after the final norm: never captured here)
        features = torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)  # [n, 3H]
        emb = target.model.embed_tokens.weight[tokens[1:]]  # [n, H]: pair j = (token j + 1, feature j)
    n, nh, nkv, hd = emb.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def norm(x, name):
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])

    def rope(x):  # [n, heads, hd], positions 0 .. n-1
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(n).float(), inv)
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    m = "midlayer."
    g = features @ w["fc.weight"].T  # [n, H]
    h = torch.cat([norm(emb, m + "input_layernorm.weight"), norm(g, m + "hidden_norm.weight")], -1)  # [n, 2H]
    q = rope((h @ w[m + "self_attn.q_proj.weight"].T).view(n, nh, hd)).transpose(0, 1)
    kk = rope((h @ w[m + "self_attn.k_proj.weight"].T).view(n, nkv, hd)).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    v = (h @ w[m + "self_attn.v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    attn = torch.softmax((q @ kk.transpose(1, 2)) / hd ** 0.5 + torch.full((n, n), -torch.inf).triu(1), -1) @ v
    x = g + attn.transpose(0, 1).reshape(n, -1) @ w[m + "self_attn.o_proj.weight"].T
    y = norm(x, m + "post_attention_layernorm.weight")
    x = x + (torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)) \
        @ w[m + "mlp.down_proj.weight"].T
    top = (norm(x[-1], "norm.weight") @ w["lm_head.weight"].T).topk(k).indices  # draft-vocabulary ids
    return (top + w["d2t"][top]).tolist() if "d2t" in w else top.tolist()


def test_eagle3_drafts_follow_the_public_format(derived_pair, tmp_path):
    """The proposer's root drafts (ranks 0-3) equal a dense reading of the SafeAILab EAGLE-3 format, with a
    reduced draft vocabulary; the engine feeds it the captured layers' outputs, not the final hidden state."""
    target_dir, _ = derived_pair
    heads = make_random_eagle3(target_dir, tmp_path / "eagle3", dtype="float32", draft_vocab_size=200)
    target = LlamaModel.from_hf(target_dir, "float32")
    tokens = prompts(1, seed=4)[0]
    expected = dense_eagle3_top_k(heads, target_dir, tokens, EAGLE3_LAYERS, 4)
    kv = target.new_kv_cache(8, 32)
    features = target([SequenceInput(tokens[:-1], 0, list(range(8)))], kv, return_hidden=True,
                      capture_layers=EAGLE3_LAYERS).hidden_states  # [n, 3H]
    proposer = EagleProposer.from_eagle_dir(heads, target, choices=[[0], [1], [2], [3]], layers_to_capture=EAGLE3_LAYERS)
    assert proposer.capture_layers == EAGLE3_LAYERS
    [draft] = proposer.propose([ProposalInput("a", tokens, 4, hidden_states=features)])
    assert draft.token_ids == expected and draft.parents == [-1, -1, -1, -1]
    d2t = load_file(heads / "model.safetensors")["d2t"]
    assert set(draft.token_ids) <= set((torch.arange(200) + d2t).tolist())  # target ids of draft-vocabulary entries


def test_eagle3_capture_layers_are_checked(derived_pair, tmp_path):
    from pipeline.spec import SpecError

    target_dir, _ = derived_pair
    heads = make_random_eagle3(target_dir, tmp_path / "eagle3", dtype="float32")
    target = LlamaModel.from_hf(target_dir, "float32")
    with pytest.raises(SpecError, match="layers_to_capture: the target has 4 layers"):
        EagleProposer.from_eagle_dir(heads, target, choices=[[0]])  # TensorRT-LLM's default needs > 5 layers
    with pytest.raises(ValueError, match="fuses 3 target layers"):
        EagleProposer.from_eagle_dir(heads, target, choices=[[0]], layers_to_capture=(0, 1))
    with pytest.raises(ValueError, match="EAGLE-1/2"):
        EagleProposer.from_eagle_dir(random_eagle_dir(tmp_path / "eagle"), target, choices=[[0]], layers_to_capture=(0, 1, 2))
