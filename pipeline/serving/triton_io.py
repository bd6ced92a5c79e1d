"""Glue between Triton's python backend objects and numpy (imported only inside the server's models)."""

from __future__ import annotations

import faulthandler
import json
import signal

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving.errors import RequestError, Stopped, Unavailable
from pipeline.serving.heartbeat import PENDING_SENDS


def enable_fault_dumps() -> None:
    """Python stacks of every thread of this stub on stderr (the server's log): at a crash (SIGSEGV, SIGABRT...)
    and on SIGUSR1 (`kill -USR1 <stub pid>` shows what a stuck stub is doing)."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def model_parameters(args: dict) -> dict[str, str]:
    """The string parameters of the model's config.pbtxt (from initialize's args)."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def model_config(args: dict) -> dict:
    """The model's config as a dict (from initialize's args)."""
    return json.loads(args["model_config"])


def request_inputs(request, names: list[str]) -> dict[str, np.ndarray]:
    """Every input of `request` among `names` that the client sent, as numpy arrays (one pass over the request's
    inputs: pb_utils.get_input_tensor_by_name rebuilds the whole input list on every call)."""
    wanted = set(names)
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs() if tensor.name() in wanted}


def request_parameter(request, name: str) -> str:
    """A string parameter of a Triton request ("" where the request has none of that name)."""
    value = json.loads(request.parameters() or "{}").get(name, "")
    return value if isinstance(value, str) else ""


def response_outputs(response) -> dict[str, np.ndarray]:
    """Every output tensor of a model's response, as numpy arrays (one pass, as `request_inputs`)."""
    return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}


def tensors(arrays: dict[str, np.ndarray]) -> list:
    """pb_utils.Tensor list from name -> array."""
    return [pb_utils.Tensor(name, array) for name, array in arrays.items()]


def send(sender, arrays: dict[str, np.ndarray], flags: int = 0) -> None:
    """Send one response with `arrays` as its outputs. The tensors stay referenced from Python until the send
    returns: Triton 2.51's ResponseSender::Send drops the outputs the caller did not request while it does not
    hold the GIL, and a tensor's last reference must not go there (pipeline.serving.stub_keeper)."""
    outputs = tensors(arrays)
    send_response(sender, pb_utils.InferenceResponse(output_tensors=outputs), flags)


def send_response(sender, response=None, flags: int = 0) -> None:
    """sender.send(response, flags) (response None: the flags alone), counted in flight while it waits
    (heartbeat.PENDING_SENDS: a send that never returns makes the stub not live). Every response of the text models
    goes out through here."""
    with PENDING_SENDS.track():
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)


def error_response(exc: BaseException):
    """A response carrying the error: INVALID_ARG for request problems, UNAVAILABLE while shutting down,
    CANCELLED for a stopped request, INTERNAL otherwise."""
    if isinstance(exc, RequestError):
        err = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
    elif isinstance(exc, Unavailable):
        err = pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
    elif isinstance(exc, Stopped):
        err = pb_utils.TritonError(f"cancelled: {exc}", pb_utils.TritonError.CANCELLED)
    else:
        err = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def send_final_error(sender, exc: BaseException) -> None:
    """Close a decoupled request with an error response, so the client never waits forever."""
    try:
        send_response(sender, error_response(exc), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as send_exc:  # the request is already closed (cancelled, or its final response went out)
        pb_utils.Logger.log_warn(f"could not send error response ({exc}): {send_exc}")
