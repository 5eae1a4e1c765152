"""The plain-torch core: DomainSurgery, losses, entropies and the trainer (docs/design.md §3)."""

import math

import pytest
import torch

from mergekit_darts.repair.capture.entropy import token_entropy
from mergekit_darts.repair.train.kl import kl_loss
from mergekit_darts.repair.train.losses import per_position_l1, surgery_loss
from mergekit_darts.remote_code.surgery import DomainSurgery, count_parameters
from mergekit_darts.repair.train.loop import train_surgery


def positions(n, t):
    return torch.arange(t).expand(n, t).clone()


@pytest.mark.parametrize("method", ["darts", "standard"])
def test_identity_at_init(method):
    torch.manual_seed(0)
    s = DomainSurgery(hidden_size=32, rank=4, max_positions=8, method=method)
    h = torch.randn(3, 11, 32)
    assert torch.equal(s(h, positions(3, 11)), h)
    assert torch.equal(s.content(h), torch.zeros_like(h))


def test_head_correction_is_zero_at_init():
    torch.manual_seed(0)
    s = DomainSurgery(hidden_size=32, rank=4, max_positions=8, head_rank=3, vocab_size=50)
    h = torch.randn(2, 5, 32)
    assert torch.equal(s(h, positions(2, 5)), h)
    assert torch.equal(s.head_correction(h), torch.zeros(2, 5, 50))
    assert DomainSurgery(hidden_size=32, rank=4).head_correction(h) is None
    assert set(s.state_dict()) == {"down.weight", "up.weight", "position_bias", "head_down.weight", "head_up.weight"}


def test_parameter_counts_and_state_dict():
    h, r, t = 64, 16, 512
    darts = DomainSurgery(hidden_size=h, rank=r, max_positions=t, method="darts")
    standard = DomainSurgery(hidden_size=h, rank=r, max_positions=t, method="standard")
    assert count_parameters(darts) == 2 * r * h + t * h
    assert count_parameters(standard) == 2 * r * h
    assert set(darts.state_dict()) == {"down.weight", "up.weight", "position_bias"}
    assert set(standard.state_dict()) == {"down.weight", "up.weight"}
    assert darts.down.bias is None and darts.up.bias is None
    assert standard.position_bias is None
    # the paper's figure: H=4096, r=16, T_max=512
    assert 2 * 16 * 4096 + 512 * 4096 == 2_228_224
    head = DomainSurgery(hidden_size=h, rank=r, max_positions=t, head_rank=4, vocab_size=100)
    assert count_parameters(head) == 2 * r * h + t * h + (100 + h) * 4


def test_forward_matches_definition_and_positions_beyond_table():
    torch.manual_seed(0)
    s = DomainSurgery(hidden_size=16, rank=3, max_positions=4, method="darts")
    with torch.no_grad():
        s.up.weight.normal_()
        s.position_bias.normal_()
    h = torch.randn(2, 6, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 7]])
    out = s(h, pos)
    content = torch.relu(h @ s.down.weight.T) @ s.up.weight.T
    expected = h - content
    for b in range(2):
        for t in range(6):
            p = int(pos[b, t])
            if p < 4:
                expected[b, t] -= s.position_bias[p]
    assert torch.allclose(out, expected, atol=1e-6)
    # beyond max_positions only the content correction applies
    assert torch.allclose(out[0, 4:], (h - content)[0, 4:], atol=1e-6)


def test_bfloat16_inputs_run_in_float32():
    torch.manual_seed(0)
    s = DomainSurgery(hidden_size=16, rank=3, max_positions=4)
    with torch.no_grad():
        s.up.weight.normal_()
    h = torch.randn(1, 4, 16).bfloat16()
    out = s(h, positions(1, 4))
    assert out.dtype == torch.bfloat16
    ref = (h.float() - s.content(h.float())).bfloat16()
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rank=0), "rank"),
        (dict(max_positions=0), "max_positions"),
        (dict(method="magic"), "method"),
        (dict(head_rank=2), "vocab_size"),
    ],
)
def test_bad_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DomainSurgery(hidden_size=8, **kwargs)


def test_bad_shapes_are_errors_not_broadcasts():
    s = DomainSurgery(hidden_size=8, rank=2, max_positions=4)
    with pytest.raises(ValueError, match="position_ids"):
        s(torch.randn(2, 3, 8), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden_states"):
        s(torch.randn(2, 3, 9), positions(2, 3))
    h = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="target"):
        surgery_loss("l1", h, torch.randn(2, 3, 1), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        surgery_loss("l1", h, h, torch.ones(2, 1))
    with pytest.raises(ValueError, match="loss"):
        surgery_loss("huber", h, h, torch.ones(2, 3))
    with pytest.raises(ValueError, match="entropy"):
        surgery_loss("ewl1", h, h, torch.ones(2, 3))
    with pytest.raises(ValueError, match="entropy"):
        surgery_loss("ewl1", h, h, torch.ones(2, 3), entropy=torch.ones(3))
    with pytest.raises(ValueError, match="position_ids"):
        train_surgery(s, h, h, torch.ones(2, 3), torch.zeros(3, 2), loss="l1", steps=1)
    with pytest.raises(ValueError, match="loss"):
        train_surgery(s, h, h, torch.ones(2, 3), positions(2, 3), loss="nope", steps=1)


def test_losses_against_hand_computation():
    a = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]])
    b = torch.tensor([[[0.0, 0.0], [3.0, 2.0], [0.0, 0.0]]])
    m = torch.tensor([[1, 1, 0]])
    w = torch.tensor([[1.0, 3.0, 100.0]])
    # D = mean |a-b| over H: [1.5, 1.0, (masked)]
    assert math.isclose(surgery_loss("l1", a, b, m).item(), (1.5 + 1.0) / 2)
    assert math.isclose(surgery_loss("ewl1", a, b, m, entropy=w).item(), (1 * 1.5 + 3 * 1.0) / 4)
    # squared: [(1+4)/2, (0+4)/2] = [2.5, 2.0]
    assert math.isclose(surgery_loss("mse", a, b, m).item(), (2.5 + 2.0) / 2)
    assert math.isclose(surgery_loss("ewmse", a, b, m, entropy=w).item(), (2.5 + 3 * 2.0) / 4)
    cos1 = (3 * 3 + 4 * 2) / (5 * math.sqrt(13))
    expected = ((1 - 0.0) + (1 - cos1)) / 2
    assert abs(surgery_loss("cosine", a, b, m).item() - expected) < 1e-6
    # the first position's target is zero: cosine similarity 0 (torch's eps), so its term is 1 - 0
    zero = torch.nn.functional.cosine_similarity(a[:, :1], b[:, :1], dim=-1)
    assert zero.item() == 0.0
    # l1 equals torch's L1Loss on the valid positions
    assert math.isclose(
        surgery_loss("l1", a, b, m).item(), torch.nn.L1Loss()(a[0, :2], b[0, :2]).item(), rel_tol=1e-6
    )


def test_masked_positions_have_no_influence_on_loss_or_gradients():
    torch.manual_seed(0)
    n, t, h = 4, 6, 16
    merged, target = torch.randn(n, t, h), torch.randn(n, t, h)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[:, :2] = False  # left padding
    pos = (torch.arange(t) - 2).clamp(min=0).expand(n, t)
    entropy = torch.rand(n, t)
    grads = []
    for fill in (0.0, 1e3):
        m2, t2, e2 = merged.clone(), target.clone(), entropy.clone()
        m2[~mask], t2[~mask], e2[~mask] = fill, -fill, fill
        torch.manual_seed(1)
        s = DomainSurgery(hidden_size=h, rank=4, max_positions=8)
        with torch.no_grad():
            s.up.weight.normal_()
        for name in ("l1", "ewl1", "mse", "cosine"):
            s.zero_grad()
            loss = surgery_loss(name, s(m2, pos), t2, mask, entropy=e2)
            loss.backward()
            grads.append((name, loss.item(), [p.grad.clone() for p in s.parameters()]))
    half = len(grads) // 2
    for (name, l_a, g_a), (_, l_b, g_b) in zip(grads[:half], grads[half:]):
        assert math.isclose(l_a, l_b, rel_tol=1e-5), name
        for x, y in zip(g_a, g_b):
            assert torch.allclose(x, y, atol=1e-5), name


def _synthetic(n, t, h, seed):
    """merged = target + offset growing with position + an input-dependent term."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, t, h, generator=g)
    growth = torch.linspace(0.2, 2.0, t).unsqueeze(-1) * torch.randn(t, h, generator=g)
    mix = torch.randn(h, h, generator=g) * 0.3 / math.sqrt(h)
    return target, growth, mix


def _make(target, growth, mix):
    merged = target + growth + torch.relu(target @ mix)
    return merged


def test_darts_beats_standard_beats_nothing_on_position_dependent_bias():
    n, t, h = 48, 24, 32
    target, growth, mix = _synthetic(n + 16, t, h, seed=0)
    merged = _make(target, growth, mix)
    mask = torch.ones(n + 16, t, dtype=torch.bool)
    pos = positions(n + 16, t)
    train, held = slice(0, n), slice(n, n + 16)
    results = {}
    for method in ("standard", "darts"):
        torch.manual_seed(0)
        s = DomainSurgery(hidden_size=h, rank=8, max_positions=t, method=method)
        train_surgery(s, merged[train], target[train], mask[train], pos[train], loss="l1", steps=300, lr=1e-2)
        with torch.no_grad():
            results[method] = surgery_loss("l1", s(merged[held], pos[held]), target[held], mask[held]).item()
    none = surgery_loss("l1", merged[held], target[held], mask[held]).item()
    assert results["darts"] < 0.7 * results["standard"], (results, none)
    assert results["standard"] < 0.9 * none, (results, none)


def test_ewl1_focuses_on_high_entropy_positions():
    n, t, h = 32, 16, 32
    g = torch.Generator().manual_seed(3)
    merged = torch.randn(n, t, h, generator=g)
    # the merged states look alike on both halves of the positions but need conflicting
    # corrections: a module without a position table cannot fix both, so the weighting decides
    offset = torch.zeros(n, t, h)
    offset[:, : t // 2] = torch.randn(h, generator=g) * 2
    offset[:, t // 2:] = torch.randn(h, generator=g) * 2
    target = merged - offset
    mask = torch.ones(n, t, dtype=torch.bool)
    pos = positions(n, t)
    entropy = torch.full((n, t), 0.01)
    entropy[:, : t // 2] = 5.0
    subset = torch.zeros(n, t, dtype=torch.bool)
    subset[:, : t // 2] = True
    errors = {}
    for loss in ("l1", "ewl1"):
        torch.manual_seed(0)
        s = DomainSurgery(hidden_size=h, rank=2, max_positions=t, method="standard")
        train_surgery(s, merged, target, mask, pos, entropy=entropy, loss=loss, steps=300, lr=1e-2)
        with torch.no_grad():
            errors[loss] = surgery_loss("l1", s(merged, pos), target, subset).item()
    assert errors["ewl1"] < 0.8 * errors["l1"], errors


def test_training_is_deterministic_and_reduces_loss():
    n, t, h = 8, 10, 16
    target, growth, mix = _synthetic(n, t, h, seed=1)
    merged = _make(target, growth, mix).bfloat16()
    mask = torch.ones(n, t, dtype=torch.bool)
    pos = positions(n, t)
    entropy = torch.rand(n, t, generator=torch.Generator().manual_seed(0))
    states = []
    for _ in range(2):
        torch.manual_seed(5)
        s = DomainSurgery(hidden_size=h, rank=4, max_positions=t)
        history = train_surgery(s, merged, target.bfloat16(), mask, pos, entropy=entropy, loss="ewl1",
                                steps=40, lr=1e-2, batch_size=3, seed=7)
        states.append(s.state_dict())
        assert len(history) == 40 and history[-1] < history[0]
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


def test_token_entropy_chunked_matches_naive():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16).bfloat16()
    head = torch.randn(50, 16)
    naive = torch.distributions.Categorical(logits=hidden.float() @ head.T).entropy()
    chunked = token_entropy(hidden, head, chunk_size=4)
    assert chunked.shape == (3, 7) and chunked.dtype == torch.float32
    assert torch.allclose(chunked, naive, atol=1e-5)
    # a low-precision head is prepared once per pass: float32 where the device cannot multiply it into
    # float32 outputs (the CPU), the same numbers either way
    from mergekit_darts.repair.capture.entropy import entropy_head

    low = head.bfloat16()
    prepared = entropy_head(low, "cpu")
    assert prepared.dtype == torch.float32 and torch.equal(prepared, low.float())
    assert torch.equal(token_entropy(hidden, prepared, chunk_size=4), token_entropy(hidden, low, chunk_size=4))


def _naive_kl(corrected, expert_hidden, expert_head, merged_head, head=None):
    log_p = torch.log_softmax(expert_hidden @ expert_head.T, -1)
    logits = corrected @ merged_head.T
    if head is not None:
        logits = logits + head(corrected)
    log_q = torch.log_softmax(logits, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


@pytest.mark.parametrize("head_rank", [0, 3])
def test_kl_loss_and_gradients_match_naive(head_rank):
    torch.manual_seed(0)
    h, v = 16, 40
    s = DomainSurgery(hidden_size=h, rank=4, max_positions=8, head_rank=head_rank, vocab_size=v)
    with torch.no_grad():
        s.up.weight.normal_()
        if head_rank:
            s.head_up.weight.normal_()
    merged, expert = torch.randn(2, 5, h), torch.randn(2, 5, h)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    pos = positions(2, 5)
    w_e, w_m = torch.randn(v, h), torch.randn(v, h)
    head = s.head_correction if head_rank else None

    loss = surgery_loss("kl", s(merged, pos), expert, mask, expert_head=w_e, merged_head=w_m,
                        head_correction=head, chunk_size=3)
    loss.backward()
    grads = [p.grad.clone() for p in s.parameters()]
    s.zero_grad()
    corrected = s(merged, pos)
    ref = _naive_kl(corrected[mask], expert[mask], w_e, w_m, head)
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5)
    for a, b in zip(grads, (p.grad for p in s.parameters())):
        assert torch.allclose(a, b, atol=1e-5)
    # chunked == unchunked
    with torch.no_grad():
        whole = kl_loss(corrected[mask], expert[mask], w_e, w_m, head, chunk_size=10_000)
        small = kl_loss(corrected[mask], expert[mask], w_e, w_m, head, chunk_size=1)
    assert torch.allclose(whole, small, atol=1e-6)


def test_kl_chunking_bounds_memory():
    """With checkpointed chunks, autograd keeps no [M, V] tensor: saved activations stay small."""
    torch.manual_seed(0)
    m, h, v, chunk = 512, 16, 2000, 32
    corrected = torch.randn(m, h, requires_grad=True)
    expert = torch.randn(m, h)
    w_e, w_m = torch.randn(v, h), torch.randn(v, h)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = kl_loss(corrected, expert, w_e, w_m, chunk_size=chunk)
    assert max(saved) < m * v / 4, max(saved)
    saved_naive = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_naive.append(t.numel()) or t, lambda t: t):
        _naive_kl(corrected, expert, w_e, w_m)
    assert max(saved_naive) >= m * v  # the naive computation does keep the whole thing
    loss.backward()
    assert corrected.grad is not None


def test_kl_training_closes_distribution_gap():
    torch.manual_seed(0)
    n, t, h, v = 6, 8, 16, 30
    expert = torch.randn(n, t, h)
    merged = expert + 0.5 * torch.randn(1, 1, h)
    w = torch.randn(v, h)
    mask = torch.ones(n, t, dtype=torch.bool)
    pos = positions(n, t)
    s = DomainSurgery(hidden_size=h, rank=4, max_positions=t, method="standard", head_rank=2, vocab_size=v)
    history = train_surgery(s, merged, expert, mask, pos, loss="kl", steps=150, lr=1e-2,
                            expert_head=w, merged_head=w, kl_chunk_size=7)
    assert history[-1] < 0.3 * history[0]


def test_per_position_l1_bins_by_position_ids():
    states = torch.zeros(2, 3, 2)
    target = torch.tensor([[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], [[9.0, 9.0], [4.0, 4.0], [6.0, 6.0]]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    pos = torch.tensor([[0, 1, 2], [0, 0, 1]])
    out = per_position_l1(states, target, mask, pos)
    assert torch.allclose(out, torch.tensor([(1 + 4) / 2, (2 + 6) / 2, 3.0]))
