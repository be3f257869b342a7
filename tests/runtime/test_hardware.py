"""runtime.hardware: the dtype batched work uses follows whether bf16 is native on the device."""

import pytest
import torch

from runtime import hardware


@pytest.mark.parametrize("native", [True, False])
def test_batch_dtype_is_bf16_only_where_bf16_is_native(monkeypatch, native):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    assert hardware.native_bf16("cpu") is native
    assert hardware.batch_dtype("cpu") == (torch.bfloat16 if native else torch.float32)



def test_cpu_summary_names_the_cpu_and_only_the_flags_that_decide_speed(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    summary = hardware.cpu_summary()
    assert summary["model"] and summary["cores"] >= 1 and summary["native_bf16"] is True
    assert set(summary["flags"]) <= set(hardware.SPEED_FLAGS)
