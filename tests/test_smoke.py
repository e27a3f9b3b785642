import torch


def test_write_read_roundtrip(client):
    h = client.allocate(0)
    start = h.extend(10)
    k = torch.randn(10, 4, 8)
    v = torch.randn(10, 4, 8)
    h.write(0, k, v, start=start)
    assert torch.equal(h.key_cache(0), k)
    assert torch.equal(h.value_cache(0), v)
