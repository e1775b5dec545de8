import pytest
import torch

from kvsieve.cache import CacheFullError, PagedKVCache


def test_write_read_roundtrip_at_awkward_lengths():
    c = PagedKVCache(num_layers=2, num_kv_heads=3, head_dim=8, num_pages=40, page_size=16)
    g = torch.Generator().manual_seed(0)
    data = {}
    for req, n in enumerate([1, 54, 97]):
        c.reserve(req, n)
        k, v = torch.randn(3, n, 8, generator=g), torch.randn(3, n, 8, generator=g)
        # write in two uneven parts, as chunked prefill + decode would
        cut = n // 3
        for layer in range(2):
            c.write(layer, req, 0, k[:, :cut], v[:, :cut])
            c.write(layer, req, cut, k[:, cut:], v[:, cut:])
        data[req] = (k, v)
    for req, (k, v) in data.items():
        rk, rv = c.read(1, req, k.shape[1])
        assert torch.equal(rk, k) and torch.equal(rv, v)
        # the layout the paged kernels read: token t in page table[t // 16], slot t % 16
        table = c.tables[req]
        for t in range(k.shape[1]):
            assert torch.equal(c.k[1, table[t // 16], :, t % 16], k[:, t]) and torch.equal(c.v[0, table[t // 16], :, t % 16], v[:, t])
        # rows computed once and passed as at= read and write the same places
        at = c.rows(req, 0, k.shape[1])
        assert torch.equal(c.read(0, req, k.shape[1], at=at)[0], k)
        c.write(0, req, 5 % k.shape[1], k[:, 5 % k.shape[1]:] * 2, v[:, 5 % k.shape[1]:], at=at[:, 5 % k.shape[1]:])
        assert torch.equal(c.read(0, req, k.shape[1])[0][:, 5 % k.shape[1]:], 2 * k[:, 5 % k.shape[1]:])
        for start, end in ((0, k.shape[1]), (k.shape[1] // 2, k.shape[1]), (k.shape[1] - 1, k.shape[1])):
            # a span's keys alone (a fold's read), at pages not aligned to it
            assert torch.equal(c.read_keys(1, c.rows(req, start, end - start)), k[:, start:end])
    kk, vv = c.view(1, [2, 0], [97, 1])
    assert torch.equal(kk[0], data[2][0]) and torch.equal(kk[1, :, :1], data[0][0]) and (kk[1, :, 1:] == 0).all()


def test_pool_exhaustion_is_a_clear_error_and_release_frees_pages():
    c = PagedKVCache(1, 1, 4, num_pages=4, page_size=16)
    c.reserve(0, 50)  # 4 pages
    assert c.bytes_used() == 4 * c.page_bytes == 4 * 2 * 16 * 4 * 4
    with pytest.raises(CacheFullError, match="KV cache pool exhausted: request 1 needs 1 more pages"):
        c.reserve(1, 1)
    c.release(0)
    c.reserve(1, 64)
    assert c.bytes_used() == 4 * c.page_bytes


def test_write_beyond_reservation_is_refused():
    c = PagedKVCache(1, 1, 4, num_pages=4, page_size=16)
    c.reserve(0, 10)
    with pytest.raises(CacheFullError, match="without reserving"):
        c.write(0, 0, 10, torch.zeros(1, 7, 4), torch.zeros(1, 7, 4))


def test_requests_do_not_share_pages():
    c = PagedKVCache(1, 1, 4, num_pages=8, page_size=4)
    c.reserve(0, 9)
    c.reserve(1, 9)
    assert not set(c.tables[0]) & set(c.tables[1])


@pytest.mark.parametrize("page_size", [1, 2, 16, 64, 3, 48])
def test_page_and_slot_is_floor_division_and_remainder(page_size):
    """The shift-and-mask path (powers of two) equals // and % for every integer, negatives included."""
    from kvsieve.cache.paged import page_and_slot
    pos = torch.arange(-300, 300, dtype=torch.long)
    for x in (pos, pos.int()):
        page, slot = page_and_slot(x, page_size)
        assert torch.equal(page, x // page_size) and torch.equal(slot, x % page_size)
        assert page.dtype == x.dtype and slot.dtype == x.dtype
