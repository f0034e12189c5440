"""cpu_device_context on a host without a GPU (both lanes: torch's CPU build on 3.11, PyPI's CUDA
build without a driver on 3.12)."""

import pytest
import torch

from nemo_sspo.megatron.cpu_shims import cpu_device_context

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are off on a GPU host")


def test_current_stream_waits_return_at_once_inside_and_raise_outside():
    # megatron-core 0.19's start_grad_sync calls torch.cuda.current_stream().wait_event(...)
    original = torch.cuda.current_stream
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_stream()
    with cpu_device_context():
        stream = torch.cuda.current_stream()
        assert stream.wait_event(object()) is None and stream.wait_stream(object()) is None
        torch.cuda.synchronize()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.current_stream is original


def test_current_stream_is_restored_when_the_block_raises():
    original = torch.cuda.current_stream
    with pytest.raises(ValueError, match="inside"):
        with cpu_device_context():
            raise ValueError("inside")
    assert torch.cuda.current_stream is original
