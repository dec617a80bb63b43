"""benchmarks/stream_read.cpp, the multi-stream read the floors' bandwidth comes from: it must read
every element exactly once, whatever the stream count, thread count and length (a reader that
skipped a tail or a stream would measure a rate for bytes it never read)."""

import time

import pytest
import torch

from benchmarks import common
from tests.utils.threads import on_thread_counts

stream_sum = common._native_stream_sum()
pytestmark = pytest.mark.skipif(stream_sum is None, reason="no C++ compiler for the benchmark stream reader")


@pytest.mark.parametrize("n", [1, 63, 64 * 8 - 1, 64 * 8 * 5 + 17, 100_003])
@pytest.mark.parametrize("streams", [1, 3, 8])
def test_stream_sum_reads_every_element_once(n, streams):
    # Distinct powers of two per position: a skipped or doubled element changes the sum by far
    # more than rounding can.
    x = torch.ldexp(torch.ones(n), torch.arange(n) % 20 - 10)
    for total in on_thread_counts(lambda: stream_sum(x, streams)):
        assert total == pytest.approx(x.double().sum().item(), rel=1e-6)


def test_stream_sum_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="streams must be at least 1"):
        stream_sum(torch.ones(16), 0)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        stream_sum(torch.ones(16, dtype=torch.float64), 1)


def test_read_bandwidth_takes_the_faster_reader(monkeypatch):
    """The floor's read rate is the faster of torch's sum and the native streams."""
    megabytes = 16
    monkeypatch.setattr(common, "_native_stream_sum", lambda: lambda x, streams: time.sleep(0.02))
    torch_rate = common.measured_read_bandwidth("cpu", megabytes)  # the native reader's 0.8 GB/s loses
    assert torch_rate > 2 * megabytes * 2**20 / 0.02
    monkeypatch.setattr(common, "_native_stream_sum", lambda: lambda x, streams: 0.0)
    assert common.measured_read_bandwidth("cpu", megabytes) > 10 * torch_rate  # an instant one wins
