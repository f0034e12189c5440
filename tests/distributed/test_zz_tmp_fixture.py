import time, pytest
import torch, torch.distributed as dist
def _fail_rank1(rank, ws):
    if rank == 1:
        raise ValueError("boom from rank 1")
    t = torch.ones(1); dist.all_reduce(t)   # rank 0 blocks: peer is gone
def _hang(rank, ws):
    time.sleep(60)
def _ret(rank, ws, x):
    return torch.full((2,), float(rank + x))
def test_fail(run_distributed):
    with pytest.raises(RuntimeError, match="boom from rank 1"):
        run_distributed(_fail_rank1, 2)
def test_hang(run_distributed):
    t0 = time.time()
    with pytest.raises(TimeoutError):
        run_distributed(_hang, 2, timeout_s=8)
    assert time.time() - t0 < 30
def test_ret(run_distributed):
    out = run_distributed(_ret, 2, 10)
    assert [o.tolist() for o in out] == [[10.0, 10.0], [11.0, 11.0]]
