"""`make bench-lookup`: the replay counts target forwards as the BLS's rounds would, the served engine's replay counts
what the engine itself does, and the tool runs end to end."""

import json

import pytest

from pipeline.apps.lookup_ceiling import LookupPolicy, Replay, main, policies, replay, replay_served
from pipeline.serving.bls import BACK_OFF_TOKENS

SERVED = LookupPolicy("served", k=5, miss_tokens=None, switch_off_below=0.0, adaptive=True)
FIXED = LookupPolicy("fixed K", k=5, miss_tokens=None, switch_off_below=0.0)
EVERY_TOKEN = LookupPolicy("every token", k=5, miss_tokens=1, switch_off_below=0.0)


def test_an_answer_that_copies_the_prompt_takes_one_forward_per_round():
    # context ...9, 1: the suffix "1" last occurred at the start, so the lookup proposes 2 3 4 5 6 (K=5), all
    # accepted plus the target's own 7; then K = remaining - 1 = 1: "6 7" matches, 8 is drafted and accepted, 9 is the
    # target's token.
    prompt, answer = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1], [2, 3, 4, 5, 6, 7, 8, 9]
    r = replay(prompt, answer, SERVED)
    assert (r.tokens, r.forwards, r.drafted, r.accepted) == (8, 2, 6, 6)
    assert r.tokens_per_forward() == 4.0
    assert r.estimated_speedup(0.5) == pytest.approx(8 / (2 + 0.5 * 6))


def test_a_lookup_miss_decodes_k_plus_1_tokens_served_and_one_token_every_token():
    prompt, answer = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # nothing ever repeats
    for policy in (SERVED, EVERY_TOKEN):
        r = replay(prompt, answer, policy)
        assert (r.forwards, r.drafted, r.accepted) == (10, 0, 0)  # plain decoding: one forward per token
    # the answer repeats itself after a miss: the served policy decodes 6 tokens plainly before it looks again,
    # every token looks up after each token and catches the repeat at once
    prompt, answer = [1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9]
    served, every = replay(prompt, answer, SERVED), replay(prompt, answer, EVERY_TOKEN)
    assert every.forwards < served.forwards <= len(answer)
    assert every.accepted > served.accepted > 0


def test_the_switch_off_backs_off_after_eight_rounds_or_once_the_rounds_rule_out_the_bar_then_drafts_again():
    # groups 1 2 <new>: after <new> the lookup misses and 1 is decoded; after 1 it proposes what followed the last 1
    # (2 then an older <new>): 2 is accepted, the rest rejected: 1 of 5 (20 %). Misses and drafts are rounds, as in
    # the BLS. Against a 30 % bar each draft's 1 of 2 positions checked leaves room (a position's acceptance may still
    # be 0.86 after 4 drafts): the window of 8 rounds decides. A 100 % bar is ruled out by the first draft.
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    answer = [x for i in range(30) for x in (1, 2, 100 + i)]

    def at(bar, n=len(answer)):
        return replay(prompt, answer[:n], LookupPolicy(f"bar {bar}", 5, 1, switch_off_below=bar))

    never, window, strict = at(0.0), at(0.3), at(1.0)
    assert 0 < never.accepted < never.drafted  # partial acceptance
    assert strict.tokens == window.tokens == never.tokens == len(answer)
    assert strict.drafted < window.drafted < never.drafted
    assert window.forwards > never.forwards  # backing off from accepted 2s costs forwards
    # 8 rounds (4 misses, 4 drafts: 12 tokens), then 16 plain tokens
    assert at(0.3, 12 + BACK_OFF_TOKENS).forwards == 8 + BACK_OFF_TOKENS
    # a miss and one draft (3 tokens), then 16 plain tokens, then drafting again
    first = at(1.0, 3 + BACK_OFF_TOKENS)
    assert (first.forwards, first.drafted) == (2 + BACK_OFF_TOKENS, 5)
    assert at(1.0, 3 + BACK_OFF_TOKENS + 3).drafted > 5


def test_a_partly_rejected_draft_makes_the_next_one_shorter_and_a_full_accept_longer_up_to_k():
    # each group repeats "1 2 3 4 5 6" up to a new token: the lookup after "1" proposes 2 3 4 5 6 <old new token>;
    # the old new token is rejected, so with the adaptive schedule the next drafts shrink (fewer rejected tokens
    # drafted) while every token the copy brings is still accepted
    prompt = [1, 2, 3, 4, 5, 6, 99]
    answer = [x for i in range(6) for x in (1, 2, 3, 4, 5, 6, 100 + i)]
    adaptive, fixed = replay(prompt, answer, SERVED), replay(prompt, answer, FIXED)
    assert adaptive.tokens == fixed.tokens == len(answer)
    assert adaptive.drafted < fixed.drafted and adaptive.accepted / adaptive.drafted > fixed.accepted / fixed.drafted
    copy = replay([1, 2, 3, 4, 5, 6, 7, 8, 9, 1], [2, 3, 4, 5, 6, 7, 8, 9], SERVED)
    assert (copy.forwards, copy.drafted) == (2, 6)  # all accepted: K stays at its cap, 5


def test_the_ceiling_policy_never_switches_off_and_drafts_16():
    served, uncut, fixed, every, oracle, ceiling = policies(5, 0.3, 1, 3, 0.4)
    assert (served.k, served.miss_tokens, every.miss_tokens, ceiling.k, ceiling.switch_off_below) == (5, None, 1, 16, 0.0)
    assert (oracle.k, oracle.miss_tokens, oracle.switch_off_below, oracle.oracle) == (5, 1, 0.0, True)
    assert not any(policy.oracle for policy in (served, uncut, fixed, every, ceiling))
    assert served.adaptive and uncut.adaptive and not (fixed.adaptive or every.adaptive or ceiling.adaptive)
    assert served.switch_off_below == uncut.switch_off_below == fixed.switch_off_below == every.switch_off_below == 0.3
    assert served.min_token_prob == 0.4 and uncut.min_token_prob == fixed.min_token_prob == ceiling.min_token_prob == 0
    assert Replay().tokens_per_forward() == 0.0


def test_the_oracle_drafts_only_accepted_tokens_and_takes_the_forwards_of_drafting_every_token():
    # a copied stretch, a new word, then the stretch again with a change: drafts accepted in full, in part, not at all
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    answer = [1, 2, 3, 4, 5, 40, 41, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2]
    oracle = LookupPolicy("oracle", k=5, miss_tokens=1, switch_off_below=0.0, oracle=True)
    every = LookupPolicy("every token", k=5, miss_tokens=1, switch_off_below=0.0)
    bounded, drafting = replay(prompt, answer, oracle), replay(prompt, answer, every)
    assert bounded.drafted == bounded.accepted > 0  # no rejected row
    assert (bounded.forwards, bounded.accepted) == (drafting.forwards, drafting.accepted)
    assert drafting.drafted > drafting.accepted  # the same lookup drafted rows the target rejected
    assert bounded.estimated_speedup(0.2) > drafting.estimated_speedup(0.2)
    assert bounded.estimated_speedup(0.0) == drafting.estimated_speedup(0.0)


# The served engine's lookup as a repository configures it, with costs that make the policy cut, probe and gate
SERVED_PARAMETERS = {"speculative_mode": "ngram", "num_draft_tokens": "4", "ngram_min": "1", "ngram_max": "3",
                     "ngram_min_token_prob": "0.3", "min_acceptance_rate": "0.1", "draft_token_cost": "1:0.2",
                     "one_token_cost": "1:0.1", "row_cost": "2:1.0,1.1,1.2,1.5"}


def test_the_served_engine_replay_counts_what_the_engine_did(tiny_spec_engines):
    """replay_served over the engine's own greedy answers gives the engine's own forwards, drafted and accepted tokens,
    request after request with the evidence carried over: it asks the repository's policy what the engine asks."""
    from pipeline.reference.engine import Request
    from pipeline.reference.sampling import SamplingParams
    from pipeline.serving.reference_adapter import load_serving_engine, lookup_proposer
    from pipeline.spec_stats import SpecStats

    engine_dir = tiny_spec_engines.spec.out_dir / "engines" / "target"
    max_draft_len = json.loads((engine_dir / "config.json").read_text())["build_config"]["max_draft_len"]
    engine = load_serving_engine(engine_dir, SERVED_PARAMETERS)
    end_id = 294  # one of the tiny model's answers below ends on it, the others on their length
    prompts = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6], [20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
               [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 30, 31, 32], [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]]
    items, counts = [], SpecStats()
    for number, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{number}", prompt, 40, SamplingParams(end_id=end_id), num_draft_tokens=4))
        answer, finish_reason = [], None
        while engine.has_unfinished():
            for out in engine.step():
                answer += out.new_token_ids
                if out.finished:
                    finish_reason = out.finish_reason
                    counts.add(out.stats)
        items.append({"prompt": prompt, "answer": answer, "max_tokens": 40, "end_id": end_id,
                      "finish_reason": finish_reason})
    replayed = replay_served(items, lookup_proposer(SERVED_PARAMETERS, max_draft_len))
    assert (replayed.forwards, replayed.drafted, replayed.accepted) == (
        counts.target_forwards, counts.draft_tokens, counts.accepted_tokens)
    reasons = [item["finish_reason"] for item in items]
    assert sorted(set(reasons)) == ["end_id", "length"]
    assert replayed.tokens == counts.generated_tokens + reasons.count("end_id")  # and each end token's step
    assert 0 < replayed.accepted < replayed.drafted  # drafts were accepted and rejected: the policy had work to do


def test_the_tool_writes_its_report_on_a_real_engine(tiny_spec_engines, tmp_path):
    prompts = tmp_path / "copy.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two three four five six one two three four"}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}) + "\n")
    engine = tiny_spec_engines.spec.out_dir / "engines" / "target"
    repo = tmp_path / "repo"  # a repository's tensorrt_llm model that looks up in the engine
    (repo / "tensorrt_llm").mkdir(parents=True)
    parameter = 'parameters {{ key: "{}" value {{ string_value: "{}" }} }}\n'
    (repo / "tensorrt_llm" / "config.pbtxt").write_text(
        'name: "tensorrt_llm"\n' + "".join(parameter.format(*item) for item in SERVED_PARAMETERS.items()))
    out = tmp_path / "out"
    assert main(["--engine", str(engine), "--tokenizer", str(tiny_spec_engines.target_dir), "--prompts", str(prompts),
                 "--max-tokens", "12", "--k", "3", "--repo", str(repo), "--out", str(out)]) == 0
    report = json.loads((out / "lookup.json").read_text())
    assert 0 <= report["draft_token_cost"] < 5
    engine, served, uncut, fixed, every, oracle, ceiling = report["policies"].values()
    assert oracle["copy"]["drafted"] == oracle["copy"]["accepted"]
    for counts in (served["copy"], uncut["copy"], fixed["copy"], every["copy"], oracle["copy"], ceiling["copy"]):
        assert 0 < counts["tokens"] <= 12 + 6 and counts["accepted"] <= counts["drafted"]
        assert 0 < counts["forwards"] <= counts["tokens"]  # drafting never costs forwards, it can only save them
    assert served["copy"]["tokens"] == every["copy"]["tokens"] == ceiling["copy"]["tokens"]  # the same answers
    # the engine's row counts each end token's step too (2 answers)
    assert served["copy"]["tokens"] <= engine["copy"]["tokens"] <= served["copy"]["tokens"] + 2
    assert 0 < engine["copy"]["forwards"] <= engine["copy"]["tokens"]
    assert "| the served engine: K<=4, the repository's policy" in (out / "lookup.md").read_text()
    assert (out / "lookup.png").stat().st_size > 0


def test_a_missing_engine_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--engine", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert "--engine" in err and "no such engine directory" in err and "make engines" in err


def test_a_malformed_ngram_range_names_the_flag(tiny_spec_engines, capsys):
    engine = tiny_spec_engines.spec.out_dir / "engines" / "target"
    with pytest.raises(SystemExit):
        main(["--engine", str(engine), "--ngram", "3"])
    assert "--ngram '3': give min_ngram,max_ngram" in capsys.readouterr().err
