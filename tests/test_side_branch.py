"""kvsieve.side_branch: work forked beside the current stream and joined before it is read."""
import pytest
import torch

from kvsieve.side_branch import SideBranch


def _work(x, fork=True):
    """Main chain and branch: the branch reads x, the main chain overwrites its own buffer.
    fork=False: the branch never forks, and join must then not wait on it. Element-wise
    ops only: their results are bitwise reproducible (CUDA's cumsum is not)."""
    branch = SideBranch(x.device)
    side = torch.zeros_like(x)
    if fork:
        with branch:
            side = (x * 2).exp()
    main = x.clone()
    for _ in range(20):
        main = main.sin() * 0.5 + 0.25
    branch.join()
    return side + main


def test_side_branch_is_the_current_stream_off_cuda():
    x = torch.arange(10.0)
    got = _work(x)
    main = x.clone()
    for _ in range(20):
        main = main.sin() * 0.5 + 0.25
    assert torch.equal(got, (x * 2).exp() + main)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fork", [True, False])
def test_side_branch_in_a_cuda_graph_equals_eager(fork):
    """Captured, the branch is a parallel path of the graph; replayed on new inputs it
    gives the eager result (the join orders the read after the branch)."""
    x = torch.randn(1 << 20, device="cuda")
    want = _work(x, fork)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _work(x, fork)  # warm-up off the default stream, as capture requires
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _work(x, fork)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _work(x, fork))
