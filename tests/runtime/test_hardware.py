"""runtime.hardware: the dtype batched work uses follows whether bf16 is native on the device."""

import pytest
import torch

from runtime import hardware


@pytest.mark.parametrize("native", [True, False])
def test_batch_dtype_is_bf16_only_where_bf16_is_native(monkeypatch, native):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    assert hardware.native_bf16("cpu") is native
    assert hardware.batch_dtype("cpu") == (torch.bfloat16 if native else torch.float32)

