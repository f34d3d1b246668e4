"""kernels.topk: the block drafter's top-k tokens and probabilities in two launches, against torch.topk + logsumexp
on random rows (vocabularies across and within one chunk), ties, -inf logits, and bad input."""
from __future__ import annotations

import pytest
import torch

from specpilot.kernels.topk import topk_probs, topk_probs_ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (tests/conftest.py)


@pytest.mark.parametrize("rows,vocab,k,block", [(1, 7, 1, 1024), (2, 101, 5, 1024), (3, 1024, 8, 1024),
                                              (2, 2500, 8, 1024), (1, 3000, 16, 1024), (2, 2500, 8, 256),
                                              (3, 1024, 8, 64)])
def test_topk_probs_match_torch(rows, vocab, k, block):
    x = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 5).to(DEV)
    tokens, probs = topk_probs(x, k, block=block)
    want_tokens, want_probs = topk_probs_ref(x, k)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


def test_ties_go_to_the_lower_index_and_minus_infinity_counts_for_nothing():
    x = torch.full((2, 1500), float("-inf"), device=DEV)
    x[:, [1400, 3, 900]] = 2.0  # three equal bests: the lower indices first
    x[:, 7] = -50.0  # a finite value below them
    tokens, probs = topk_probs(x, 4)
    assert tokens.tolist() == [[3, 900, 1400, 7]] * 2
    torch.testing.assert_close(probs[:, :3], torch.full((2, 3), 1 / 3, device=DEV))
    assert probs[0, 3].item() < 1e-20
    assert topk_probs(torch.full((1, 40), 1.0, device=DEV), 2)[0].tolist() == [[0, 1]]


def test_a_chunk_of_minus_infinity_only_leaves_the_probabilities_finite():
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(3)).to(DEV)
    x[:, 1024:] = float("-inf")  # the second chunk (1024 logits a chunk) holds no finite logit
    tokens, probs = topk_probs(x, 4)
    want_tokens, want_probs = topk_probs_ref(x, 4)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


def test_minus_zero_ties_with_zero():
    x = torch.full((1, 40), -1.0, device=DEV)
    x[0, 3], x[0, 9] = -0.0, 0.0
    assert topk_probs(x, 2)[0].tolist() == [[3, 9]]


def test_all_negative_rows():
    x = (-torch.rand(2, 1300, generator=torch.Generator().manual_seed(1)) - 1).to(DEV)
    assert torch.equal(topk_probs(x, 3)[0], topk_probs_ref(x, 3)[0])


@pytest.mark.parametrize("logits,k,match", [(torch.zeros(2, 10, dtype=torch.bfloat16), 2, "dtype"),
                                            (torch.zeros(10), 2, "shape"), (torch.zeros(2, 10), 11, "k=11"),
                                            (torch.zeros(2, 10), 0, "k=0")])
def test_bad_input_is_refused(logits, k, match):
    with pytest.raises(ValueError, match=match):
        topk_probs(logits.to(DEV), k)


def test_a_chunk_is_a_power_of_two():
    with pytest.raises(ValueError, match="block=96: must be a power of two"):
        topk_probs(torch.zeros(2, 300).to(DEV), 4, block=96)


def test_a_token_map_names_the_columns():
    """A head restricted to some vocabulary rows: column j is token token_map[j]; ties keep the lower column."""
    x = (torch.randn(3, 1300, generator=torch.Generator().manual_seed(5)) * 5).to(DEV)
    x[1, [10, 700]] = 40.0  # a tie: column 10 first
    token_map = torch.randperm(49152, generator=torch.Generator().manual_seed(6))[:1300].sort().values.to(DEV)
    tokens, probs = topk_probs(x, 6, token_map)
    want_tokens, want_probs = topk_probs_ref(x, 6, token_map)
    assert torch.equal(tokens, want_tokens)
    assert tokens[1, :2].tolist() == token_map[[10, 700]].tolist()
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="token_map"):
        topk_probs(x, 6, token_map[:-1])


@pytest.mark.parametrize("rows,vocab,k,block_n,mapped", [(3, 300, 8, 64, False), (15, 1000, 8, 64, True),
                                                         (2, 64, 4, 32, False), (1, 517, 16, 128, False)])
def test_an_lm_heads_epilogue_ranks_its_column_tiles(rows, vocab, k, block_n, mapped):
    """rmsnorm_linear(..., topk=KP): each column tile's top KP, max and sum of exp from the head's epilogue, merged
    by merge_topk: the tokens of torch.topk over the logits the same launch stores, probabilities to 1e-5."""
    from specpilot.kernels import rmsnorm_linear
    from specpilot.kernels.topk import merge_topk
    g = torch.Generator().manual_seed(vocab + rows)
    x, w = torch.randn(rows, 64, generator=g).to(DEV), (torch.randn(vocab, 64, generator=g) * 0.5).to(DEV)
    nw = (torch.rand(64, generator=g) + 0.5).to(DEV)
    token_map = torch.sort(torch.randperm(50_000, generator=g)[:vocab]).values.to(DEV) if mapped else None
    kp = max(2, 1 << (k - 1).bit_length())
    logits, parts = rmsnorm_linear(x, nw, w, 1e-5, out_dtype=torch.float32, block_n=block_n, topk=kp)
    tokens, probs = merge_topk(parts, k, token_map)
    want_tokens, want_probs = topk_probs_ref(logits, k, token_map)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
    none, parts2 = rmsnorm_linear(x, nw, w, 1e-5, out_dtype=torch.float32, block_n=block_n, topk=kp, store_y=False)
    assert none is None and all(torch.equal(a, b) for a, b in zip(parts[:3], parts2[:3]))


@pytest.mark.parametrize("kw,match", [({"topk": 6}, "power of two"), ({"topk": 128}, "topk"),
                                      ({"topk": 8, "out_dtype": torch.bfloat16}, "float32"),
                                      ({"topk": 8, "argmax": True}, "not both")])
def test_a_heads_topk_refuses_bad_settings(kw, match):
    from specpilot.kernels import rmsnorm_linear
    x, w, nw = torch.randn(2, 32).to(DEV), torch.randn(100, 32).to(DEV), torch.ones(32).to(DEV)
    with pytest.raises(ValueError, match=match):
        rmsnorm_linear(x, nw, w, 1e-5, **{"out_dtype": torch.float32, "block_n": 64, **kw})
