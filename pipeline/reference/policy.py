"""When to speculate and how far: a wrapper that applies the policy around any proposer.

Speculation only pays when enough draft tokens are accepted and the target has spare compute:
- adaptive draft length (transformers' "heuristic" candidate schedule, `update_candidate_strategy`):
  K grows by 2 after a step where every draft token was accepted, shrinks by 1 otherwise;
- switch-off: requests decode plainly while the evidence says their draft tokens do not pay:
  their acceptance so far (all their steps: a sliding window switched decent drafts off after a
  chance run of rejections) is below the switch-off bar. The bar is the larger of
  `min_acceptance_rate` of their draft tokens (0 turns the switch-off off) and what their steps cost at the
  running batch size, in plain steps of that batch (`PolicyConfig.tokens_needed`): a draft of k tokens per request
  costs a fixed part (the draft's and the verify's calls, the verify's second row) plus a part per token
  (`step_costs`, from `draft_token_costs` at K and `one_token_costs` at 1, measured by pipeline.reference.step_cost:
  a draft token of K about 0.2-0.4 of a step at batch 1 and 0.45-0.8 with 8 in flight on these CPUs, 0 on a GPU);
- the running requests decide as one: a step's draft forward and verify forward are shared by
  every request in it, and the break-even is measured with all of them speculating, so the
  evidence is the running requests' pooled acceptance, and nothing is decided before they have
  `window * num_draft_tokens` draft tokens between them (at batch 1: the request's own, after about
  `window` steps). With 8 in flight a useless draft stops after one step instead of `window`.
  Before that, the pool stops early when even an optimistic reading of the running requests' chain drafts
  cannot pay (`hopeless`; finished requests' evidence, below, fills only the window): under speculative decoding's
  usual model (pipeline.acceptance: each draft position the target checks is accepted with the same probability
  alpha, independently), alpha's 95% upper bound from the positions checked gives an expected acceptance of
  sum(alpha^i, i <= k) / k per step, and below the bar the pool stops. A useless draft stops after 3-4 steps
  where a draft token costs 0.4-0.5 of a step. Counting
  a step's k draft tokens as k independent samples (Hoeffding's margin sqrt(ln 20 / 2n) after n tokens,
  the rule before) was overconfident: a rejection ends the chain, and simulated drafts that paid 1.3x the
  bar were stopped in up to 17% of windows at K=8 (tests/test_proposers.py simulates the 5%).
  Where the running requests have fewer draft tokens than that, finished requests' evidence fills the
  rest (fading by PAST_EVIDENCE_DECAY every step): without it, every request that left and every new
  one that joined dropped the pool below the window and switched a losing batch back on (served chat
  at concurrency 4 drafted 3.3 tokens a step at 22 % acceptance, with one draft token costing 0.79 of
  a step at that batch size: 0.79x; docs/benchmarks.md). The fading lets new traffic be tried again.
  Deciding per request measured worse with 8 in flight (0.75-0.93x where the pooled decision gave
  0.92-1.01x, docs/benchmarks.md): requests left speculating alone pay for draft forwards nobody
  shares, and finish long before the others, who then run on at a smaller, less efficient batch.
  The decision is taken every step, so a batch switched off with 8 in flight speculates again once
  it shrinks and the bar drops (at a fixed batch size it stays off: no new evidence arrives).
  A draft made for a prompt's last step (prompt lookup drafts there, from the prompt alone) is no evidence and
  does not adapt K: an answer's opening words ("Here is the rewritten text:") rarely copy the prompt, so with 8
  requests in flight that one step's misses switched prompt lookup off for good on prompts whose answers then
  accepted 56% (make bench-engine's 8 in flight, docs/benchmarks.md);
- slow start: where a draft token has a cost, a pool that has not yet had a draft token accepted (REACH_EVIDENCE in
  the fading first-position evidence) drafts one token per chain (`slow_start_limit`). Under the early stop's model a
  rejection at the first position is the same evidence at K=1 as at K, so such a probe stands for the draft of K it
  cut, at one draft forward and one verify row instead of K: the weak draft's (acceptance 0, K=4) first 10 steps cost
  3.2-5.1 ms more than plain's instead of 4.9-7.6 ms (docs/benchmarks.md). Once a token was accepted, chains are as
  long as pays at the first position's acceptance alpha so far (the longest k <= K whose sum(alpha^i, i <= k) covers
  its step's measured cost, `PolicyConfig.step_costs`; at K no limit), so one lucky probe no longer opens drafts of K:
  the weak trained-pair draft (first-position acceptance 12%) had its second probe accepted and then drafted 4 tokens
  for six steps before the early stop ended it, 5% of its 128 tokens' time. (Growing one position per position
  accepted through held decent drafts below the K the break-even was measured at, whose higher acceptance there then
  cleared that K's bar: the trained pair at K=4 switched off 2-3 steps later.)
- batch gate (TensorRT-LLM's Drafter concurrency gate, `should_use_spec_decode`): when more
  than `max_batch_for_speculation` requests run, or when a draft token costs a whole step at the
  running batch size (break-even >= 1: no acceptance can pay), nobody speculates this step. The
  running batch is the requests the policy follows (from their first proposal until release()), so a
  proposal for one request alone (the step that completes its prompt) is gated like the others;
- draft positions that do not pay: where a draft token has a measured cost at the running batch size, a draft ends
  before the first position whose pooled acceptance through it is below that cost (`useful_positions`): at 4 in flight
  a fifth draft token costs more than the little it brings, at batch 1 it is nearly free;
- long matches where the pool is off (prompt lookup: its drafts carry the length of the match they were copied after,
  `Draft.match_length`): where the switch-off has turned the pool off, the class of a request's match length (1,
  2-3, 4-7, 8-15, 16 or more tokens) decides its draft (`class_limit`), from the first positions of every chain
  draft after such matches (pooled, fading), against a draft token's cost at the running batch size (or
  min_acceptance_rate where higher): at EARLY_STOP_RISK, a class whose acceptance is surely above it drafts K, one
  surely below it nothing, any other one token, whose outcome is more evidence. A long match is a likelier copy: on
  SmolLM2's answers to grounded prompts the first draft token was accepted 43% of the time after a one-token match and
  95% after 9 or more; with 8 in flight on the AVX2 host, where a draft token cost 0.67 of a step, the pooled
  switch-off turned prompt lookup off on those prompts (1.05 tokens a forward) though their long matches paid
  (docs/benchmarks.md). These drafts are not the pool's evidence (it stays what the pool's own drafts said). Deciding
  per class (and position) where the pool is on as well measured worse: the classes split the evidence five ways,
  and served chat at 4 in flight drafted on through classes just above their bar (0.87-0.95x of plain against 1.00x);
- a step's rows (`fit_rows`): where a step's cost per draft row count is measured at the running batch size
  (`PolicyConfig.row_costs`), the step's drafts are cut to the row count that brings the most tokens per unit of step
  time, its tokens taken in order of their chance of acceptance. A cost per draft token averages over the jumps where
  a row begins a new block of the AVX2 int8 GEMM (6 rows): at 4 in flight three one-token probes (7 rows) cost 1.59
  plain steps for 0.33 tokens each (served chat, docs/benchmarks.md), while two would have cost 1.07;
- short outputs: requests with max_new_tokens below `min_new_tokens_for_speculation` never
  speculate, and K never exceeds the tokens a request still needs.
A request without speculation still goes to the wrapped proposer with num_tokens = 0 where that proposer
follows the target's hidden states (EAGLE buffers every step's features). A proposer that reads only the committed
tokens (prompt lookup; a draft model, whose cache catches up at its next draft) is not asked in a step where
nobody drafts: a switched-off step of the trained pair then costs the policy alone (it cost about 20 us more, 3%
of that pair's step, building the proposer's inputs and its empty drafts); and the engine asks `skips_step` before it
builds the step's inputs at all (TensorRT-LLM's Drafter gate): a switched-off step then costs the policy's bookkeeping,
and where neither the running requests nor their evidence changed since a switch-off that holds until they do, only the
fading (the weak trained-pair draft: 0.940x -> 0.958-0.962x of plain in the same interleaved runs, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.acceptance import EARLY_STOP_RISK, ChainEvidence, acceptance_upper_bound, chain_accepted
from pipeline.reference.proposers import Draft, ProposalInput, Proposer
from pipeline.sequences import MATCH_LENGTH_CAP, next_draft_len

# Slow start: accepted first-position draft tokens (pooled, fading) that end it (PolicyProposer.slow_start_limit)
REACH_EVIDENCE = 0.5
# Draft tokens a draft position needs (pooled, fading like the finished requests' evidence) before its acceptance can
# end drafts there (PolicyProposer.useful_positions)
POSITION_EVIDENCE = 16
# Finished requests' pooled evidence is multiplied by this every step (half-life about 70 steps, 1-2 s at
# SmolLM2's CPU step times), so what it says about the traffic fades and new requests get tried again.
PAST_EVIDENCE_DECAY = 0.99
# Classes of prompt lookup's match lengths: class c holds lengths 2^c .. 2^(c+1) - 1, the last one the cap
MATCH_CLASSES = MATCH_LENGTH_CAP.bit_length()
# Fading keeps its counts divided by the fading since its last rescale; below this factor it rescales them
RESCALE_BELOW = 1e-100
PAST_ACCEPTED, PAST_PROPOSED, PAST_STEPS = range(3)  # FadingCounts indices of PolicyProposer.past


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the speculation policy (defaults from pipeline.spec.SpeculativeSpec)."""

    num_draft_tokens: int = 4  # K a request starts with
    max_draft_tokens: int = 8  # K never exceeds this (the engine's max_draft_len)
    adaptive: bool = False  # adapt K per request from its acceptance
    min_acceptance_rate: float = 0.1  # pooled acceptance below this stops speculation (0: never)
    window: int = 8  # the switch-off decides once the running requests proposed window * num_draft_tokens
    # break-even acceptance per running batch size: ((batch, cost of one draft token in drafts of K, in plain steps
    # of that batch), ...), in any order (kept sorted by batch), measured by pipeline.reference.step_cost; linear
    # between points, the nearest point beyond them; () = free (a GPU). The switch-off asks the accepted tokens to
    # cover the steps' cost (`tokens_needed`) and min_acceptance_rate of the draft tokens.
    draft_token_costs: tuple[tuple[int, float], ...] = ()
    # the same for drafts of one token per request (measured at K=1), in the same form; with it a speculative step
    # costs a fixed part plus a part per draft token (`step_costs`), without it K times the cost per draft token
    one_token_costs: tuple[tuple[int, float], ...] = ()
    # per running batch size, a step's cost with 0, 1, 2, ... draft rows in plain steps of that batch: ((batch, (1.0,
    # cost with 1 row, ...)), ...), measured by pipeline.reference.step_cost.row_costs; () = none (`fit_rows` cuts
    # nothing)
    row_costs: tuple[tuple[int, tuple[float, ...]], ...] = ()
    max_batch_for_speculation: int = 32  # larger running batches decode plainly
    min_new_tokens_for_speculation: int = 8  # shorter requests decode plainly
    # batch size -> (break_even, fixed, per_token), filled as batch sizes are asked (`_costs`): a step asks for them
    # up to 5 times
    _costs_by_batch: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("draft_token_costs", "one_token_costs"):
            object.__setattr__(self, name, tuple(sorted(getattr(self, name))))  # by batch size

    @classmethod
    def from_spec(cls, speculative, adaptive: bool = False,
                  draft_token_costs: tuple[tuple[int, float], ...] = ()) -> "PolicyConfig":
        """Take K, the limits and the thresholds from a `pipeline.spec.SpeculativeSpec` (and measured costs)."""
        return cls(num_draft_tokens=speculative.num_draft_tokens, max_draft_tokens=speculative.max_draft_len,
                   adaptive=adaptive, min_acceptance_rate=speculative.min_acceptance_rate,
                   draft_token_costs=draft_token_costs,
                   max_batch_for_speculation=speculative.max_batch_for_speculation,
                   min_new_tokens_for_speculation=speculative.min_new_tokens_for_speculation)

    def break_even(self, batch_size: int) -> float:
        """The acceptance a draft token must reach to pay at this running batch size with drafts of K (0 when
        unmeasured): below it no draft length pays, since the fixed part of a step's cost (`step_costs`) weighs most
        on short drafts."""
        return self._costs(batch_size)[0]

    def step_costs(self, batch_size: int) -> tuple[float, float]:
        """(fixed, per_token): a speculative step whose requests draft k >= 1 tokens each costs fixed + per_token * k
        plain steps of this batch more than a plain step, through the measured costs at K and at 1 (`one_token_costs`;
        without them (0, break_even)). The trained pair's draft at batch 1 (make bench-engine's; scratch costk.py,
        2026-12-04, two runs) cost 0.80-0.94 of a step at k=1, 0.95-1.30 at 2, 1.26-1.67 at 3 and 1.44-2.00 at 4:
        the draft's and the verify's calls and the verify's second row cost most of a step, each further token
        0.1-0.4. A linear model through K's cost (0.36-0.50 a token) priced its one-token probes at 0.4-0.5 of a step
        and its drafts cut to 2 tokens at 0.7-1.0, instead of 0.80-0.94 and 0.95-1.30. Served prompt lookup on
        SmolLM2's int8 engine at batch 1 read 0.01-0.27 for one token and 0.14-0.56 for 5 in fresh processes, linear
        in some, affine in others (docs/benchmarks.md)."""
        return self._costs(batch_size)[1:]

    def _costs(self, batch_size: int) -> tuple[float, float, float]:
        """(break_even, fixed, per_token) at this batch size, interpolated once per batch size."""
        costs = self._costs_by_batch.get(batch_size)
        if costs is None:
            k, at_k = self.num_draft_tokens, _at_batch(self.draft_token_costs, batch_size)
            at_one = _at_batch(self.one_token_costs, batch_size)
            if k <= 1 or at_one <= at_k:
                costs = (at_k, 0.0, at_k)
            else:
                per_token = max((k * at_k - at_one) / (k - 1), 0.0)
                costs = (at_k, k * (at_k - per_token), per_token)
            self._costs_by_batch[batch_size] = costs
        return costs

    def tokens_needed(self, batch_size: int, steps: float, draft_tokens: float) -> float:
        """The accepted tokens that `steps` speculative steps with `draft_tokens` draft tokens between them must bring
        to pay at this batch size: their cost in plain steps (`step_costs`), or min_acceptance_rate of their draft
        tokens when that is more (min_acceptance_rate 0: none, the switch-off is off)."""
        if self.min_acceptance_rate <= 0:
            return 0.0
        fixed, per_token = self.step_costs(batch_size)
        return max(self.min_acceptance_rate * draft_tokens, fixed * steps + per_token * draft_tokens)


def _at_batch(points: tuple[tuple[int, float], ...], batch_size: int) -> float:
    """The cost at this batch size from measured (batch, cost) points sorted by batch: linear between points, the
    nearest point beyond them; 0 without points."""
    if not points:
        return 0.0
    for (b0, c0), (b1, c1) in zip(points, points[1:]):
        if batch_size <= b1:
            return c0 if batch_size <= b0 else c0 + (c1 - c0) * (batch_size - b0) / (b1 - b0)
    return points[-1][1]


def _match_class(draft: Draft) -> int | None:
    """The class of a draft's match length (MATCH_CLASSES): 1 -> 0, 2-3 -> 1, 4-7 -> 2, 8-15 -> 3, the cap (16) -> 4;
    None for a draft without one."""
    return min(draft.match_length, MATCH_LENGTH_CAP).bit_length() - 1 if draft.match_length else None


class Fading:
    """The policy's pooled evidence, counts that all fade by PAST_EVIDENCE_DECAY at every `fade()` (once a step), each
    fade one multiplication: every count (a `FadingCounts` made by `counts`) is kept divided by `factor`, what the
    counts have faded by since they were last rescaled, and read multiplied by it. A step that nobody drafts in only
    asks the policy's gate, yet with the weak trained-pair draft switched off such steps cost 11-15 us more than plain
    decoding's 0.43 ms ones (engines stepped in turns); fading every count there (four new lists and three products a
    step) was about 3 us of that (docs/benchmarks.md)."""

    def __init__(self):
        self.factor = 1.0
        self._counts: list[FadingCounts] = []

    def counts(self, size: int) -> "FadingCounts":
        """`size` new counts, at 0, that fade with the others."""
        counts = FadingCounts(self, size)
        self._counts.append(counts)
        return counts

    def fade(self) -> None:
        """One step's fading of every count."""
        self.factor *= PAST_EVIDENCE_DECAY
        if self.factor < RESCALE_BELOW:  # before the kept counts grow out of float range
            for counts in self._counts:
                counts.kept = [x * self.factor for x in counts.kept]
            self.factor = 1.0


class FadingCounts:
    """A list of counts of a `Fading` (which keeps the factor they are read with)."""

    def __init__(self, fading: Fading, size: int):
        self.fading = fading
        self.kept = [0.0] * size  # each count divided by fading.factor

    def add(self, i: int, amount: float) -> None:
        """Count `amount` more at index i."""
        self.kept[i] += amount / self.fading.factor

    def __getitem__(self, i: int) -> float:
        return self.kept[i] * self.fading.factor

    def __len__(self) -> int:
        return len(self.kept)


@dataclass
class _RequestPolicy:
    """What the policy remembers about one request."""

    draft_len: int
    accepted: int = 0  # draft tokens accepted so far
    proposed: int = 0  # draft tokens proposed so far
    steps: int = 0  # steps it drafted in so far
    # proposed for with generated tokens in its context (not its prompt's last step), as of the last step the policy
    # worked out (a step `skips_step` finds unchanged does not mark it: only a step that proposes reads it)
    answer_started: bool = False
    chain: bool = True  # its last draft was a chain (a tree's nodes are not draft positions)
    chain_evidence: ChainEvidence = field(default_factory=ChainEvidence)  # its chain steps', for the early stop
    probe_for: int = 0  # its draft this step was cut by the slow start from this length (0: not cut)
    match_class: int | None = None  # the class of its draft's match length this step (None: no draft or no length)
    by_class: bool = False  # its draft this step was let through by its match class while the pool was off


class PolicyProposer:
    """A proposer that applies `PolicyConfig` around another proposer."""

    def __init__(self, inner: Proposer, config: PolicyConfig):
        self.inner, self.config = inner, config
        self.needs_hidden_states = inner.needs_hidden_states
        self.capture_layers = getattr(inner, "capture_layers", None)
        self.drafts_at_prefill = getattr(inner, "drafts_at_prefill", False)
        self.by_match_length = getattr(inner, "reports_match_length", False)  # long matches draft where the pool is off
        self.requests: dict[str, _RequestPolicy] = {}  # running requests (release() forgets them)
        self.fading = Fading()  # the pooled evidence below fades with it
        # finished requests' evidence (`pays`): draft tokens accepted, proposed, and steps (the PAST_* indices)
        self.past = self.fading.counts(3)
        # per draft position i: draft tokens proposed there, and accepted through there (the pool's)
        self.position_proposed = self.fading.counts(config.max_draft_tokens)
        self.position_accepted = self.fading.counts(config.max_draft_tokens)
        # per class of match length: first draft positions checked, and accepted (every request's)
        self.match_proposed = self.fading.counts(MATCH_CLASSES)
        self.match_accepted = self.fading.counts(MATCH_CLASSES)
        self._by_class = False  # this step: the pool is off, and each draft's match class decides (`_class_drafts`)
        self.evidence_version = 0  # counts changes of the running requests' evidence (update, release)
        self._hopeless_verdict: tuple[tuple[int, int] | None, bool] = (None, False)  # `hopeless`'s last (key, verdict)
        self._begun_limit: int | None = None  # the limit of a step `skips_step` began and propose() finishes
        # the running requests (request_ids) and evidence_version of the last step `skips_step` switched off where that
        # holds until either changes (`_step_limit`; None: none): their later steps skip the verdict. A weak draft
        # switched off cost 8 us more a step than plain decoding with it worked out, 2 us without (about 0.8 ms of its
        # 128-token request's 50 ms; docs/benchmarks.md)
        self._off_requests: list[str] | None = None
        self._off_version = -1

    def _state(self, request_id: str) -> _RequestPolicy:
        """What the policy remembers about this request (a new request starts at K)."""
        state = self.requests.get(request_id)
        if state is None:
            cfg = self.config
            state = _RequestPolicy(draft_len=min(cfg.num_draft_tokens, cfg.max_draft_tokens))
            self.requests[request_id] = state
        return state

    def _step_limit(self, batch_size: int) -> tuple[int, bool]:
        """The most draft tokens any request may draft this step at this running batch size, decided once for the
        running requests together: 0 past the batch gate or below the switch-off bar, else `useful_positions`; and
        whether a limit of 0 holds until the running requests or their evidence change: the batch gate holds, and so
        does the switch-off bar unless the finished requests' fading evidence decides it (`_pays`)."""
        if self.gated(batch_size):
            return 0, True
        pays, fading_decides = self._pays(batch_size)
        if not pays:
            return 0, not fading_decides
        return self.useful_positions(batch_size), False

    def gated(self, batch_size: int) -> bool:
        """The batch gate: nobody speculates at this running batch size, past max_batch_for_speculation or where a
        draft token costs a whole step (with the switch-off on: no acceptance pays)."""
        cfg = self.config
        return (batch_size > cfg.max_batch_for_speculation
                or cfg.min_acceptance_rate > 0 and cfg.break_even(batch_size) >= 1)

    def draft_len(self, state: _RequestPolicy, inp: ProposalInput, limit: int) -> int:
        """K for this request (`state`: what the policy remembers of it) this step (0 = decode plainly), at most the
        step's `limit` (`_step_limit`)."""
        if limit == 0:
            return 0
        cfg = self.config
        k = min(state.draft_len, inp.num_tokens, limit)
        if inp.max_new_tokens is not None:
            if inp.max_new_tokens < cfg.min_new_tokens_for_speculation:
                return 0
            k = min(k, inp.max_new_tokens - inp.num_generated - 1)  # the verify step adds one more token itself
        return max(k, 0)

    def pays(self, batch_size: int) -> bool:
        """Whether the running requests' evidence so far clears the switch-off bar at this batch size: their accepted
        tokens cover what their steps cost (`PolicyConfig.tokens_needed`)."""
        return self._pays(batch_size)[0]

    def _pays(self, batch_size: int) -> tuple[bool, bool]:
        """(`pays`, whether the finished requests' fading evidence decides it: it fills the window). Where it does
        not, the verdict holds until the running requests or their evidence change: the running requests fill the
        window alone, or the finished requests' evidence, weighed whole, leaves it short, and only fades further."""
        cfg = self.config
        # the running requests as one (a step's draft and verify forwards are shared), once they have the evidence;
        # finished requests' evidence fills what the running ones lack of the window
        window = cfg.window * cfg.num_draft_tokens
        running = self.requests.values()
        proposed, accepted, steps = (sum(r.proposed for r in running), sum(r.accepted for r in running),
                                     sum(r.steps for r in running))
        past_proposed = self.past[PAST_PROPOSED]
        past_fills = proposed < window and past_proposed > 0
        if past_fills:
            share = min(1.0, (window - proposed) / past_proposed)
            proposed, accepted = proposed + share * past_proposed, accepted + share * self.past[PAST_ACCEPTED]
            steps += share * self.past[PAST_STEPS]
        if proposed >= window - 1e-9:
            return accepted >= cfg.tokens_needed(batch_size, steps, proposed), past_fills
        return not self.hopeless(batch_size), False  # before the window is full: stop only a draft that cannot pay

    def hopeless(self, batch_size: int) -> bool:
        """Whether the running requests' chain drafts so far rule out paying at this batch size (see the module
        docstring and pipeline.acceptance): even at alpha's upper bound their steps bring fewer accepted tokens than
        the steps need (`PolicyConfig.tokens_needed`)."""
        key = (self.evidence_version, batch_size)
        if self._hopeless_verdict[0] != key:  # a switched-off batch asks every step; its evidence no longer changes
            pool = ChainEvidence.pooled(r.chain_evidence for r in self.requests.values())
            verdict = pool.optimistic_accepted() < self.config.tokens_needed(batch_size, pool.steps, pool.draft_tokens)
            self._hopeless_verdict = (key, verdict)
        return self._hopeless_verdict[1]

    def useful_positions(self, batch_size: int) -> int:
        """How many leading draft positions pay at this batch size: a draft ends before the first position (after the
        first) whose pooled acceptance through it is below what one more draft token costs (`step_costs`' per_token),
        once that position has POSITION_EVIDENCE draft tokens. Drafting position i brings a token with the probability
        that the drafts reaching it are accepted through it, and costs one draft token: at 4 in flight on code prompts
        K=5 brought 1.42 tokens a step against K=2's 1.35 while its verify cost 0.69 of a step against 0.84 (make
        bench, docs/benchmarks.md). The evidence fades, so a position ruled out is tried again after some steps."""
        cost = self.config.step_costs(batch_size)[1]
        for i in range(1, len(self.position_proposed)):
            if self.position_proposed[i] >= POSITION_EVIDENCE and self.position_accepted[i] < cost * self.position_proposed[i]:
                return i
        return len(self.position_proposed)

    def class_limit(self, match_class: int, batch_size: int) -> int:
        """How many tokens a draft after a match of this class (`_match_class`) may have at this running batch size
        where the pool is off (see the module docstring): the bar is what a draft token costs (`step_costs`'
        per_token), or min_acceptance_rate where higher; at EARLY_STOP_RISK, K where the class's first-position
        acceptance is surely above it, 0 where it is surely below, else 1 (a probe: its outcome is more evidence). The
        evidence fades, so a class ruled out is probed again after some steps."""
        cfg = self.config
        checked, accepted = self.match_proposed[match_class], self.match_accepted[match_class]
        if checked < 1:
            return 1
        bar = max(cfg.step_costs(batch_size)[1], cfg.min_acceptance_rate)
        if 1 - acceptance_upper_bound(checked - accepted, checked, EARLY_STOP_RISK) >= bar:
            return cfg.max_draft_tokens
        return 0 if acceptance_upper_bound(accepted, checked, EARLY_STOP_RISK) < bar else 1

    def slow_start_limit(self, batch_size: int) -> int:
        """The most draft tokens a chain may have under the slow start (see the module docstring), where a draft token
        has a cost at this batch size: 1 until the pool has had one accepted (lately: the evidence fades, so a pool
        that switched a draft off probes it again with one token), then the longest draft of at most K that pays at the
        first position's pooled acceptance (1 if none, no limit at K); without a cost no limit."""
        cfg, no_limit = self.config, len(self.position_accepted)
        if cfg.break_even(batch_size) <= 0:
            return no_limit
        accepted, proposed = self.position_accepted[0], self.position_proposed[0]
        if accepted < REACH_EVIDENCE:
            return 1
        fixed, per_token = cfg.step_costs(batch_size)
        longest = max((k for k in range(2, cfg.num_draft_tokens + 1)
                       if chain_accepted(accepted / proposed, k) >= fixed + per_token * k), default=1)
        return no_limit if longest == cfg.num_draft_tokens else longest

    def skips_step(self, request_ids: list[str], num_generated: list[int]) -> bool:
        """The engine's gate before it builds a step's proposal inputs (TensorRT-LLM's Drafter gate,
        `should_use_spec_decode`), for the running requests request_ids with num_generated tokens each: True where
        nobody drafts this step and the wrapped proposer has nothing to follow, the step then done as a propose() of
        empty drafts would do it (the evidence fades, new requests are followed); else False, and the next propose()
        finishes the step begun here. The weak trained-pair draft's runs, switched off after their first few steps,
        went from 0.944x / 0.949x to 0.948x / 0.957x of plain with it (two alternating A/Bs, docs/benchmarks.md)."""
        if self._off_version == self.evidence_version and self._off_requests == request_ids:
            self.fading.fade()  # the step's bookkeeping where nothing it decides on has changed (`_off_requests`)
            return True
        limit, holds = self._begin_step(request_ids, num_generated)
        if self._nobody_asked(limit):
            self._off_version, self._off_requests = self.evidence_version, list(request_ids) if holds else None
            return True
        self._off_requests, self._begun_limit = None, limit
        return False

    def _begin_step(self, request_ids: list[str], num_generated: list[int]) -> tuple[int, bool]:
        """A step's bookkeeping: the evidence fades, the requests are followed (a request joins at its first step) and
        marked as having begun their answers or not; returns the step's limit at the running batch, and whether a limit
        of 0 holds until the running requests or their evidence change (`_step_limit`)."""
        self.fading.fade()
        for request_id, generated in zip(request_ids, num_generated):
            self._state(request_id).answer_started = generated > 0
        batch_size = len(self.requests)
        limit, holds = self._step_limit(batch_size)
        # the pool switched off (not gated): the match classes decide each draft (`_class_drafts`)
        self._by_class = limit == 0 and self.by_match_length and not self.gated(batch_size)
        return limit, holds

    def _nobody_asked(self, limit: int) -> bool:
        """Whether a step of this limit leaves the wrapped proposer unasked: nobody drafts, and it has nothing to follow
        (it does not read the target's hidden states)."""
        return limit == 0 and not self._by_class and not self.needs_hidden_states

    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """Ask the wrapped proposer for K_i tokens per request, K_i chosen by the policy at the running batch size
        (the requests it follows: a request joins at its first proposal, also one alone for its prompt's last step).
        Finishes a step `skips_step` began, else begins one."""
        limit, self._begun_limit = self._begun_limit, None
        if limit is None:
            limit, _ = self._begin_step([inp.request_id for inp in inputs], [inp.num_generated for inp in inputs])
        if self._nobody_asked(limit):
            return [Draft(token_ids=[]) for _ in inputs]
        states = [self.requests[inp.request_id] for inp in inputs]
        drafts = self._class_drafts(inputs, states) if self._by_class else self._pool_drafts(inputs, states, limit)
        return self.fit_rows(drafts, states)

    def _pool_drafts(self, inputs: list[ProposalInput], states: list[_RequestPolicy], limit: int) -> list[Draft]:
        """A step where the pool decides: each request's draft of K (`draft_len`, at most `limit`), chains cut by the
        slow start."""
        slow_start = self.slow_start_limit(len(self.requests))
        limited = []
        for state, inp in zip(states, inputs):
            k = self.draft_len(state, inp, limit)
            state.probe_for = k if state.chain and k > slow_start else 0
            limited.append(replace(inp, num_tokens=min(k, slow_start) if state.chain else k))
        drafts = self.inner.propose(limited)
        for state, draft in zip(states, drafts):
            state.chain, state.by_class = draft.parents is None, False
            state.match_class = _match_class(draft) if self.by_match_length else None
        return [d if inp.num_tokens > 0 else Draft(token_ids=[]) for d, inp in zip(drafts, limited)]

    def _class_drafts(self, inputs: list[ProposalInput], states: list[_RequestPolicy]) -> list[Draft]:
        """A step where the pool is off (`_by_class`): each request looks up a draft of its K, cut to what its match's
        class allows (`class_limit`)."""
        batch_size = len(self.requests)
        limited = [replace(inp, num_tokens=self.draft_len(state, inp, self.config.max_draft_tokens))
                   for state, inp in zip(states, inputs)]
        drafts, limits = [], {}  # limits: each class's, once a step (`class_limit` bisects its bounds)
        for state, draft in zip(states, self.inner.propose(limited)):
            match_class = _match_class(draft)
            if match_class is not None and match_class not in limits:
                limits[match_class] = self.class_limit(match_class, batch_size)
            tokens = draft.token_ids[:limits[match_class]] if match_class is not None else []
            state.chain, state.probe_for, state.by_class = True, 0, True
            state.match_class = match_class if tokens else None
            drafts.append(replace(draft, token_ids=tokens))
        return drafts

    def fit_rows(self, drafts: list[Draft], states: list[_RequestPolicy]) -> list[Draft]:
        """The step's chain drafts cut to the draft row count that brings the most tokens per unit of step time at the
        running batch size B, by the step's measured cost with each row count (`PolicyConfig.row_costs`): its draft
        tokens in order of their chance of being accepted (`_chances`), the first n of them bring B + their chances'
        sum tokens at the cost of a step with n draft rows (past the measured row counts, the last cost plus their mean
        cost a row), and the best n from 1 up is kept (whether a step drafts at all is the switch-off's call, on the
        evidence this cut would starve). Where a step's cost jumps at a row count (the AVX2 int8 GEMM's 6-row blocks:
        at 4 in flight a third draft row cost 1.28 plain steps against 1.05 for two), the unlikely tokens that would
        begin the next block go, and tokens in a block already paid for stay: in process at 4 in flight, paired
        against the same policy without it, code 1.044x, summaries 1.069x, chat 0.985x (docs/benchmarks.md).
        Unchanged without costs at this batch size; trees stay whole. A request's cut draft stands for the draft it
        was cut from (`ChainEvidence`)."""
        batch_size = len(self.requests)
        costs = dict(self.config.row_costs).get(batch_size)
        if not costs:
            return drafts
        ranked = sorted(((chance, i, j) for i, (draft, state) in enumerate(zip(drafts, states))
                         if draft.parents is None for j, chance in enumerate(self._chances(draft, state))),
                        key=lambda t: (-t[0], t[2]))
        measured, per_row = len(costs) - 1, (costs[-1] - costs[0]) / max(len(costs) - 1, 1)
        best, keep, tokens = 0.0, 0, float(batch_size)  # tokens per unit of step time, and the n that gives it
        for n, (chance, _, _) in enumerate(ranked, 1):
            tokens += chance
            cost = costs[n] if n <= measured else costs[-1] + (n - measured) * per_row
            if tokens / cost > best:
                best, keep = tokens / cost, n
        if keep == len(ranked):
            return drafts
        lengths = [0] * len(drafts)
        for _, i, j in ranked[:keep]:
            lengths[i] = max(lengths[i], j + 1)
        fitted = []
        for draft, state, length in zip(drafts, states, lengths):
            if draft.parents is None and length < len(draft.token_ids):
                state.probe_for = max(state.probe_for, len(draft.token_ids))
                state.match_class = state.match_class if length else None
                draft = replace(draft, token_ids=draft.token_ids[:length],
                                probs=draft.probs[:length] if draft.probs is not None else None)
            fitted.append(draft)
        return fitted

    def _chances(self, draft: Draft, state: _RequestPolicy) -> list[float]:
        """Each token's chance of being accepted with all before it (non-increasing): the first position's from its
        match class where the class let it through (`_class_drafts`) and from the pool otherwise, each later
        position's the first's times the pool's acceptance through it given the first, from the faded evidence with
        half a token accepted of one more proposed (no evidence: 0.5). A later position with less than
        POSITION_EVIDENCE draft tokens of evidence is priced as the one before it, as `useful_positions` waits for that
        much before it rules one out: the cut keeps a position it never drafts at the prior for good (on copy-heavy
        prompts with 8 in flight the first position's 0.9 left every later one at 0.5, drafts of one token where
        the later positions took 0.73-0.82; docs/benchmarks.md)."""
        def through(accepted: float, proposed: float) -> float:
            return (accepted + 0.5) / (proposed + 1)

        pooled_first = through(self.position_accepted[0], self.position_proposed[0])
        first = (through(self.match_accepted[state.match_class], self.match_proposed[state.match_class])
                 if state.by_class and state.match_class is not None else pooled_first)
        chances = []
        for j in range(min(len(draft.token_ids), len(self.position_accepted))):
            if j == 0:
                chance = first
            elif self.position_proposed[j] < POSITION_EVIDENCE:
                chance = chances[-1]
            else:
                chance = first * through(self.position_accepted[j], self.position_proposed[j]) / pooled_first
            chances.append(min(chance, chances[-1]) if chances else chance)
        return chances

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Adapt K and count the evidence of one verification."""
        self.inner.update(request_id, num_accepted, num_proposed)
        state = self.requests.get(request_id)
        if state is None or num_proposed == 0 or not state.answer_started:
            return  # a draft for the prompt's last step (prompt lookup's) is no evidence: see the module docstring
        cfg = self.config
        if cfg.adaptive:
            state.draft_len = next_draft_len(state.draft_len, num_accepted, num_proposed, cfg.max_draft_tokens)
        if state.match_class is not None:  # its class's first position
            self.match_proposed.add(state.match_class, 1)
            self.match_accepted.add(state.match_class, num_accepted > 0)
        if state.by_class:
            return  # let through by its class while the pool was off: not the pool's evidence (module docstring)
        state.accepted += num_accepted
        state.proposed += num_proposed
        state.steps += 1
        self.evidence_version += 1
        if state.chain:
            state.chain_evidence.add(num_accepted, num_proposed, state.probe_for)  # a probe stands for the draft it cut
            for i in range(min(num_proposed, len(self.position_proposed))):
                self.position_proposed.add(i, 1)
                self.position_accepted.add(i, i < num_accepted)

    def release(self, request_id: str) -> None:
        """Forget the request here and in the wrapped proposer; its evidence joins the finished requests'."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.evidence_version += 1
            self.past.add(PAST_ACCEPTED, state.accepted)
            self.past.add(PAST_PROPOSED, state.proposed)
            self.past.add(PAST_STEPS, state.steps)
        self.inner.release(request_id)
