"""Clients for the speculative-decoding Triton service: library, CLI, OpenAI-compatible frontend, benchmark.

Light on purpose: imports neither torch nor the reference engine.
"""

from clients.client import (AsyncTritonClient, ClientError, Completion, Delta, GenerateRequest, SamplingParams,
                            TritonClient)

__all__ = ["AsyncTritonClient", "ClientError", "Completion", "Delta", "GenerateRequest", "SamplingParams",
           "TritonClient"]
