"""Names shared across stages: the Triton models of the repository and the Prometheus metrics they export.

Used by the model repository, serving, deploy and the benchmarks. Imports nothing, so that any stage (and a
Triton model inside the server) can read it. clients/ speaks the same names on the wire but stays standalone:
tests/test_clients.py checks that its literals agree with these.
"""

# Triton models of the repository (NVIDIA's inflight_batcher_llm names).
PREPROCESSING_MODEL = "preprocessing"
POSTPROCESSING_MODEL = "postprocessing"
TARGET_MODEL = "tensorrt_llm"
DRAFT_MODEL = "tensorrt_llm_draft"
BLS_MODEL = "tensorrt_llm_bls"
ENSEMBLE_MODEL = "ensemble"
MODEL_NAMES = (PREPROCESSING_MODEL, POSTPROCESSING_MODEL, TARGET_MODEL, DRAFT_MODEL, BLS_MODEL, ENSEMBLE_MODEL)

# The request parameter by which the BLS names the chain a call to an engine continues (TextRequest.call_chain; the
# reference engine's runner regathers by it). Not the request id: a client's own request id (NVIDIA's clients set one)
# is no chain, and a request that names none holds no step.
CHAIN_PARAMETER = "specdeploy_chain"

# Metrics of the speculative BLS (modelled on vLLM's spec_decode metrics), labelled by model.
DRAFT_TOKENS_METRIC = "spec_decode_draft_tokens_total"
ACCEPTED_TOKENS_METRIC = "spec_decode_accepted_tokens_total"
ACCEPTED_PER_POSITION_METRIC = "spec_decode_accepted_tokens_per_position_total"
ACCEPTANCE_LENGTH_METRIC = "spec_decode_acceptance_length"
ROUNDS_METRIC = "spec_decode_rounds_total"
FALLBACKS_METRIC = "spec_decode_draft_fallbacks_total"
MODEL_UP_METRIC = "spec_decode_model_up"  # gauge, labels model + callee: 0 once a model the BLS calls died
IN_FLIGHT_METRIC = "spec_decode_requests_in_flight"  # gauge: requests the BLS (or ensemble) is serving now
SPEC_DECODE_METRICS = (DRAFT_TOKENS_METRIC, ACCEPTED_TOKENS_METRIC, ACCEPTED_PER_POSITION_METRIC,
                       ACCEPTANCE_LENGTH_METRIC, ROUNDS_METRIC, FALLBACKS_METRIC, MODEL_UP_METRIC, IN_FLIGHT_METRIC)
# Metrics of a reference engine model (its busy time inside step()).
ENGINE_STEP_SECONDS_METRIC = "reference_engine_step_seconds_total"
ENGINE_STEPS_METRIC = "reference_engine_steps_total"
# Seconds a working model's speculation and engine counters may lag: they are sent at most this often, and when the
# model has no work left (pipeline.serving.metrics: each update is a round trip to the server process)
METRICS_FLUSH_S = 0.5
