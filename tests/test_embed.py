"""kernels.embed: the step's embedding gather, bit for bit F.embedding on random tables of several widths (one
block, several, a power of two), both id dtypes, an `out` view into a persistent buffer, repeated ids, an id out of
range (zeros, no device assert) and bad input."""
from __future__ import annotations

import pytest
import torch

from specpilot.kernels.embed import embedding, embedding_ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (tests/conftest.py)


@pytest.mark.parametrize("vocab,hidden,tokens,dtype,id_dtype", [
    (50, 576, 16, torch.bfloat16, torch.int64), (50, 576, 1, torch.bfloat16, torch.int64),
    (300, 64, 5, torch.float32, torch.int32), (20, 1536, 3, torch.float16, torch.int64),
    (9, 1024, 17, torch.bfloat16, torch.int32)])
def test_embedding_equals_torch(vocab, hidden, tokens, dtype, id_dtype):
    g = torch.Generator().manual_seed(vocab + hidden)
    weight = torch.randn(vocab, hidden, generator=g).to(dtype).to(DEV)
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(id_dtype).to(DEV)
    ids[0] = vocab - 1  # the last row
    got = embedding(ids, weight)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert torch.equal(got, embedding_ref(ids, weight))


def test_embedding_writes_a_view_and_leaves_the_rest_of_the_buffer():
    weight = torch.randn(40, 96, dtype=torch.bfloat16).to(DEV)
    buf = torch.full((4, 96), 7.0, dtype=torch.bfloat16, device=DEV)
    ids = torch.tensor([3, 3], device=DEV)  # a repeated id: two copies of one row
    out = embedding(ids, weight, out=buf[1:3])
    assert out.data_ptr() == buf[1:3].data_ptr()
    assert torch.equal(buf[1:3], weight[[3, 3]])
    assert torch.equal(buf[0], torch.full((96,), 7.0, dtype=torch.bfloat16, device=DEV))
    assert torch.equal(buf[3], buf[0])


def test_an_id_out_of_range_gives_zeros():
    weight = torch.randn(10, 32).to(DEV)
    got = embedding(torch.tensor([2, 10, -1], device=DEV), weight)
    assert torch.equal(got[0], weight[2])
    assert torch.equal(got[1:], torch.zeros(2, 32, device=DEV))


@pytest.mark.parametrize("ids,weight,out,match", [
    (torch.tensor([0]), "strided", None, "contiguous"),
    (torch.tensor([0.0]), torch.randn(4, 8), None, "dtype"),
    (torch.tensor([[0]]), torch.randn(4, 8), None, "shape"),
    (torch.tensor([], dtype=torch.long), torch.randn(4, 8), None, "at least one"),
    (torch.tensor([0, 1]), torch.randn(4, 8), torch.empty(2, 8, dtype=torch.float16), "dtype"),
    (torch.tensor([0, 1]), torch.randn(4, 8), torch.empty(3, 8), "shape")])
def test_bad_input_is_refused(ids, weight, out, match):
    # a strided view made on the device (moving one there would copy it into a contiguous tensor)
    weight = torch.randn(4, 8, device=DEV)[:, ::2] if isinstance(weight, str) else weight.to(DEV)
    with pytest.raises(ValueError, match=match):
        embedding(ids.to(DEV), weight, out=None if out is None else out.to(DEV))
