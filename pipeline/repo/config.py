"""Typed Triton model configs, rendered to config.pbtxt through Triton's own protobuf schema.

A `ModelConfigSpec` becomes a `tritonclient.grpc.model_config_pb2.ModelConfig` message and is
printed with protobuf's text format, so a rendered file always parses and can hold no template
placeholder. No string templates are involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.repo.interface import TensorSpec


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's dynamic batcher settings."""

    max_queue_delay_microseconds: int = 0
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_size: int = 0  # 0 = unbounded


@dataclass(frozen=True)
class ModelConfigSpec:
    """Everything a config.pbtxt says, typed."""

    name: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    backend: str | None = None  # "python" | "tensorrtllm"
    decoupled: bool | None = None
    instance_count: int | None = None  # KIND_CPU instances
    dynamic_batching: DynamicBatching | None = None
    parameters: dict[str, str] = field(default_factory=dict)

    def to_proto(self) -> mc.ModelConfig:
        """The ModelConfig protobuf message."""
        cfg = mc.ModelConfig(name=self.name, max_batch_size=self.max_batch_size)
        if self.backend:
            cfg.backend = self.backend
        if self.decoupled is not None:
            cfg.model_transaction_policy.decoupled = self.decoupled
        for t in self.inputs:
            cfg.input.append(_input(t))
        for t in self.outputs:
            cfg.output.append(_output(t))
        if self.instance_count is not None:
            cfg.instance_group.append(mc.ModelInstanceGroup(count=self.instance_count, kind=mc.ModelInstanceGroup.KIND_CPU))
        if self.dynamic_batching is not None:
            db = self.dynamic_batching
            cfg.dynamic_batching.max_queue_delay_microseconds = db.max_queue_delay_microseconds
            cfg.dynamic_batching.preferred_batch_size.extend(db.preferred_batch_size)
            if db.max_queue_size:
                cfg.dynamic_batching.default_queue_policy.max_queue_size = db.max_queue_size
        for key, value in self.parameters.items():
            cfg.parameters[key].string_value = value
        return cfg

    def render(self) -> str:
        """The config.pbtxt text."""
        return text_format.MessageToString(self.to_proto())


def _dims_kwargs(t: TensorSpec) -> dict:
    return {"name": t.name, "data_type": mc.DataType.Value(t.data_type), "dims": list(t.dims)}


def _input(t: TensorSpec) -> mc.ModelInput:
    msg = mc.ModelInput(**_dims_kwargs(t), optional=t.optional, allow_ragged_batch=t.allow_ragged_batch)
    if t.reshape is not None:
        msg.reshape.SetInParent()  # present even when empty: [] reshapes to a scalar
        msg.reshape.shape.extend(t.reshape)
    return msg


def _output(t: TensorSpec) -> mc.ModelOutput:
    msg = mc.ModelOutput(**_dims_kwargs(t))
    if t.reshape is not None:
        msg.reshape.SetInParent()
        msg.reshape.shape.extend(t.reshape)
    return msg


def parse_pbtxt(text: str) -> mc.ModelConfig:
    """Parse config.pbtxt text as Triton's ModelConfig; raises text_format.ParseError."""
    return text_format.Parse(text, mc.ModelConfig())
