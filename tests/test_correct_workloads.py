"""Correct code runs under ``sanitize("strict")`` exactly as without it: no refusal, the same
results. Each workload is run twice from the same seed, once plain and once sanitized, and the
outputs are compared."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from safeview import sanitize
from safeview.testing import capture_events

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support"),
]

Workload = Callable[[], list[torch.Tensor]]


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


def transformer_forward_backward() -> list[torch.Tensor]:
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0)
    x = torch.randn(5, 3, 32)
    out = layer(x)
    out.sum().backward()  # type: ignore[no-untyped-call,unused-ignore]
    return [out.detach(), *_grads(layer)]


def lstm_forward_backward() -> list[torch.Tensor]:
    lstm = torch.nn.LSTM(8, 16, num_layers=2)
    out, (h, c) = lstm(torch.randn(6, 2, 8))
    out.sum().backward()  # type: ignore[no-untyped-call,unused-ignore]
    return [out.detach(), h.detach(), c.detach(), *_grads(lstm)]


def attention() -> list[torch.Tensor]:
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()  # type: ignore[no-untyped-call,unused-ignore]
    assert q.grad is not None
    return [out.detach(), q.grad]


def multihead_attention() -> list[torch.Tensor]:
    mha = torch.nn.MultiheadAttention(16, 4)
    x = torch.randn(5, 2, 16)
    out, weights = mha(x, x, x)
    return [out.detach(), weights.detach()]


def conv_channels_last() -> list[torch.Tensor]:
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    out = conv(x)
    out.sum().backward()  # type: ignore[no-untyped-call,unused-ignore]
    return [out.detach().contiguous(), *_grads(conv)]


def unfold_and_fold() -> list[torch.Tensor]:
    x = torch.randn(1, 2, 8, 8)
    patches = F.unfold(x, kernel_size=3, padding=1)
    return [patches, F.fold(patches, (8, 8), kernel_size=3, padding=1), x.unfold(2, 3, 1)]


def stft_istft() -> list[torch.Tensor]:
    signal = torch.randn(400)
    window = torch.hann_window(64)
    spec = torch.stft(signal, 64, hop_length=16, window=window, return_complex=True)
    return [torch.view_as_real(spec), torch.istft(spec, 64, hop_length=16, window=window)]


def complex_arithmetic() -> list[torch.Tensor]:
    z = torch.randn(4, 4, dtype=torch.complex64)
    w = (z @ z.conj().T) * 1j
    return [torch.view_as_real(w), torch.view_as_real(z.conj().resolve_conj()), z.real, z.imag]


def fft_roundtrip() -> list[torch.Tensor]:
    x = torch.randn(4, 32)
    return [torch.view_as_real(torch.fft.rfft(x)), torch.fft.irfft(torch.fft.rfft(x), 32)]


def sparse_coo_and_csr() -> list[torch.Tensor]:
    dense = torch.randn(6, 6) * (torch.rand(6, 6) > 0.5)
    coo = dense.to_sparse()
    csr = dense.to_sparse_csr()
    return [(coo @ torch.ones(6, 2)), csr.to_dense(), coo.coalesce().values()]


def quantized() -> list[torch.Tensor]:
    x = torch.randn(4, 8)
    q = torch.quantize_per_tensor(x, 0.05, 10, torch.quint8)
    return [q.dequantize(), q.int_repr()[1:3]]


def nested_tensors() -> list[torch.Tensor]:
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    return [t * 2 for t in nt.unbind()]


def meta_chain() -> list[torch.Tensor]:
    x = torch.empty(1024, 256, device="meta")
    y = x.view(256, 1024).t().reshape(-1)[10:100].unsqueeze(0).expand(4, -1)
    assert y.shape == (4, 90)
    return [torch.tensor(list(y.shape) + list(y.stride()))]


def deepcopy_and_save_load() -> list[torch.Tensor]:
    x = torch.randn(6, 4)
    pieces = [x[1:3], x.t(), torch.zeros(4, 0).chunk(2)[1], x[:, 1]]
    buffer = io.BytesIO()
    torch.save(pieces, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    return [*copy.deepcopy(pieces), *loaded]


def in_place_on_views_backward() -> list[torch.Tensor]:
    base = torch.randn(4, 5, requires_grad=True)
    y = base * 1
    y[1:3].mul_(2)
    y[:, 0].add_(1)
    y.t()[2].zero_()
    y.sum().backward()  # type: ignore[no-untyped-call,unused-ignore]
    assert base.grad is not None
    return [y.detach(), base.grad]


def empty_tensors() -> list[torch.Tensor]:
    e = torch.zeros(4, 0)
    parts = list(e.chunk(2)) + list(torch.split(e, 1)) + [e[3:], e.t(), e.reshape(0, 4)]
    return [torch.tensor([p.numel() for p in parts]), torch.cat(parts[:2])]


def splits_and_views() -> list[torch.Tensor]:
    x = torch.arange(60.0).reshape(3, 4, 5)
    return [
        *torch.split(x, 2, dim=2),
        *x.unbind(1),
        x.transpose(0, 2).contiguous(),
        x.diagonal(dim1=1, dim2=2),
        x.narrow(1, 1, 2),
        x.permute(2, 0, 1).reshape(5, -1),
        x.movedim(0, -1).flatten(),
    ]


def explicit_as_strided_windows() -> list[torch.Tensor]:
    x = torch.arange(20.0)
    return [torch.as_strided(x, (5, 4), (3, 1)), x.as_strided((2, 2), (4, 1), 8)]


def out_into_fresh_and_fitting_tensors() -> list[torch.Tensor]:
    fresh = torch.empty(0)
    torch.add(torch.ones(8), 2, out=fresh)
    buffer = torch.zeros(16)
    torch.mul(torch.ones(8), 3, out=buffer[4:12])
    torch.cat([torch.ones(2), torch.zeros(2)], out=buffer[:4])
    torch.matmul(torch.randn(3, 4), torch.randn(4, 2), out=torch.empty(3, 2))
    return [fresh, buffer]


def indexing_and_scatter() -> list[torch.Tensor]:
    x = torch.zeros(5, 6)
    index = torch.tensor([[0, 1, 2], [3, 4, 5]])
    x.scatter_(1, index, torch.ones(2, 3))
    x[torch.tensor([1, 3])] += 2
    x.index_put_((torch.tensor([0]), torch.tensor([5])), torch.tensor(9.0))
    return [x, x.gather(1, index), x[x > 1], x.masked_fill(x == 0, -1)]


def reductions_and_sorting() -> list[torch.Tensor]:
    x = torch.randn(6, 7)
    values, indices = x.sort(dim=1)
    top = x.topk(3, dim=0)
    return [values, indices, top.values, x.cumsum(1), x.max(dim=0).values, x.median(dim=1).values]


def normalisations() -> list[torch.Tensor]:
    x = torch.randn(4, 6, 5)
    bn = torch.nn.BatchNorm1d(6)
    return [
        F.layer_norm(x, (5,)),
        F.group_norm(x, 2),
        bn(x).detach(),
        torch.as_tensor(bn.running_mean).clone(),
        F.normalize(x, dim=-1),
    ]


def embeddings_and_pooling() -> list[torch.Tensor]:
    emb = torch.nn.Embedding(10, 4)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    image = torch.randn(1, 2, 8, 8)
    return [
        emb(tokens).detach(),
        F.max_pool2d(image, 2),
        F.avg_pool2d(image, 2),
        F.interpolate(image, scale_factor=2.0, mode="bilinear", align_corners=False),
    ]


def padding_and_shifts() -> list[torch.Tensor]:
    x = torch.arange(12.0).reshape(3, 4)
    return [
        F.pad(x, (1, 2, 0, 1)),
        x.roll(1, 0),
        x.flip(1),
        x.repeat_interleave(2, dim=0),
        x.tile((2, 1)),
    ]


def dropout_training() -> list[torch.Tensor]:
    x = torch.ones(100)
    return [F.dropout(x, 0.3, training=True)]


def linear_algebra() -> list[torch.Tensor]:
    a = torch.randn(4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    b = torch.randn(4, 2, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return [torch.linalg.solve(a, b), q, r, torch.linalg.inv(a), torch.einsum("ij,jk->ik", a, b)]


def where_and_clamp() -> list[torch.Tensor]:
    x = torch.randn(5, 5)
    return [torch.where(x > 0, x, -x), x.clamp(-0.5, 0.5), x.clamp_(min=0)]


def type_conversions_and_byte_views() -> list[torch.Tensor]:
    x = torch.randn(4, 8)
    raw = x.view(torch.int8)
    halves = x.to(torch.float16)
    return [raw.clone(), halves.view(torch.int16), halves.to(torch.bfloat16).float(), x.int()]


def kv_cache_layer_views() -> list[torch.Tensor]:
    """A connector's own, correct, per-layer block views of one shared int8 cache."""
    kv = torch.zeros(3 * 10 * 4096, dtype=torch.int8)
    views = []
    for layer in range(3):
        views.append(
            torch.empty(0, dtype=torch.int8).set_(
                kv.untyped_storage(), layer * 4096, (10, 4096), (3 * 4096, 1)
            )
        )
        views.append(torch.as_strided(kv, (10, 2048), (3 * 4096, 1), layer * 4096 + 2048))
    views[0].fill_(1)
    return [kv.sum(dim=0, keepdim=True).float(), *[v.float().sum(1) for v in views]]


def resize_of_own_tensors() -> list[torch.Tensor]:
    x = torch.empty(0)
    x.resize_(10).fill_(1)
    y = torch.ones(4)
    y.resize_as_(torch.empty(2, 2))
    return [x, y]


def optimizer_step() -> list[torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(6, 4)).pow(2).mean().backward()  # type: ignore[no-untyped-call,unused-ignore]
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def gru_and_rnn_cells() -> list[torch.Tensor]:
    gru = torch.nn.GRU(4, 6, batch_first=True, bidirectional=True)
    out, h = gru(torch.randn(2, 5, 4))
    cell = torch.nn.RNNCell(4, 3)
    return [out.detach(), h.detach(), cell(torch.randn(2, 4)).detach()]


def pinned_style_copies() -> list[torch.Tensor]:
    src = torch.randn(8, 16)
    dst = torch.empty(16, 8).t()
    dst.copy_(src)
    staging = torch.empty_like(src).copy_(src[:, ::2].repeat(1, 2))
    return [dst.contiguous(), staging]


def masked_and_boolean_views() -> list[torch.Tensor]:
    flags = torch.zeros(4, 16, dtype=torch.bool)
    flags[:, ::3] = True
    as_bytes = flags.view(torch.uint8)
    return [as_bytes.float(), flags.nonzero(), torch.as_strided(flags, (4, 8), (16, 2)).float()]


def float8_views() -> list[torch.Tensor]:
    x = torch.randn(4, 16).to(torch.float8_e4m3fn)
    return [x.float(), x.view(torch.uint8).float(), x[1:3].view(torch.int8).float()]


def tensor_subclass_parameter_views() -> list[torch.Tensor]:
    weight = torch.nn.Parameter(torch.randn(6, 4))
    return [weight[:, 1:3].detach(), weight.t().detach(), weight.data.view(24)]


def torch_func_vmap() -> list[torch.Tensor]:
    x = torch.randn(3, 5)
    return [torch.func.vmap(torch.sin)(x), torch.func.grad(lambda t: t.pow(2).sum())(x)]


def autograd_checkpoint() -> list[torch.Tensor]:
    from torch.utils.checkpoint import checkpoint

    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(lambda t: linear(t).relu(), x, use_reentrant=False)
    out.sum().backward()  # type: ignore[no-untyped-call,unused-ignore]
    assert x.grad is not None
    return [out.detach(), x.grad]


WORKLOADS: dict[str, Workload] = {
    name: function
    for name, function in globals().items()
    if callable(function) and getattr(function, "__module__", None) == __name__
    and not name.startswith(("_", "test")) and name != "Workload"
}  # fmt: skip


def _run(workload: Workload) -> list[torch.Tensor]:
    torch.manual_seed(1234)
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in workload()]


def test_the_suite_covers_the_workloads_the_issue_names() -> None:
    assert len(WORKLOADS) >= 38


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_correct_workload_runs_unchanged_under_strict(name: str) -> None:
    workload = WORKLOADS[name]
    plain = _run(workload)
    with capture_events() as events, sanitize("strict") as seen:
        guarded = _run(workload)
    assert seen.findings == []
    assert events == []  # no violation, and no failure of safeview's own along the way
    assert len(plain) == len(guarded)
    for a, b in zip(plain, guarded):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        assert torch.equal(a, b) or torch.allclose(a, b, equal_nan=True)
