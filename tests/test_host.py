"""pipeline/apps/host.py: the machine line that heads make bench-kernels and make bench-serve."""

import torch

from pipeline.apps.host import ISA_CHECKS, cpu_model, cpu_summary


def test_cpu_model_reads_the_model_name_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Example CPU @ 2.0GHz\nflags\t\t: fpu\n")
    assert cpu_model(str(info)) == "Example CPU @ 2.0GHz"
    assert cpu_model(str(tmp_path / "missing")) == "unknown CPU"
    (tmp_path / "bare").write_text("processor\t: 0\n")
    assert cpu_model(str(tmp_path / "bare")) == "unknown CPU"


def test_cpu_summary_lists_exactly_the_instruction_sets_torch_detects():
    line = cpu_summary()
    assert line.startswith(cpu_model())
    listed = line.split("torch sees ", 1)[1]
    for name, fn in ISA_CHECKS.items():
        detected = getattr(torch.cpu, fn)()
        assert (name in listed.split(", ")) == detected, name
