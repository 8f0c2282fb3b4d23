"""Ecosystem-style models in plain torch, tiny widths and random weights (no downloads), as torchvision, timm,
Ultralytics and Hugging Face build them: a ResNet of BasicBlocks, a MobileNetV3 of inverted residuals with
squeeze-excite and hard-swish, a ViT, a BERT-style encoder, a per-token MLP, a YOLOv5-style detector and a
GPT-2-style decoder. `tests/frontend/test_onnx_ecosystem.py` and `bench/onnx_models.py` export them with
`torch.onnx.export`. `full_size()` builds the same kinds at their published sizes (ResNet-50, MobileNetV3-Large, a
BERT-base layer) for the benchmark."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SqueezeExcite(nn.Module):
    def __init__(self, c, squeeze):
        super().__init__()
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expansion (none where `expand == cin`), depthwise `kernel`, optional squeeze-excite
    of `squeeze` channels, 1x1 projection; `act` is hard-swish or ReLU as the block's row of the paper says."""

    def __init__(self, cin, expand, cout, stride, kernel=3, squeeze=None, act=nn.Hardswish):
        super().__init__()
        self.expand = (nn.Sequential(nn.Conv2d(cin, expand, 1, bias=False), nn.BatchNorm2d(expand), act())
                       if expand != cin else nn.Identity())
        self.depthwise = nn.Sequential(nn.Conv2d(expand, expand, kernel, stride, kernel // 2, groups=expand,
                                                 bias=False), nn.BatchNorm2d(expand), act())
        self.se = SqueezeExcite(expand, squeeze or max(expand // 4, 4)) if squeeze != 0 else nn.Identity()
        self.project = nn.Sequential(nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class MobileNetV3(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(8, 16, 8, 1), InvertedResidual(8, 24, 12, 2))
        self.head = nn.Sequential(nn.Linear(12, 16), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(16, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.head(torch.flatten(x, 1))


class MBConv(nn.Module):
    """EfficientNet's block: 1x1 expansion, depthwise conv, sigmoid squeeze-and-excitation, 1x1 projection, with
    SiLU activations (stochastic depth is the identity in eval)."""

    def __init__(self, cin, expand, cout, kernel, stride):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(cin, expand, 1, bias=False), nn.BatchNorm2d(expand), nn.SiLU())
        self.depthwise = nn.Sequential(nn.Conv2d(expand, expand, kernel, stride, kernel // 2, groups=expand,
                                                 bias=False), nn.BatchNorm2d(expand), nn.SiLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(expand, max(cin // 4, 1), 1), nn.SiLU(),
                                nn.Conv2d(max(cin // 4, 1), expand, 1), nn.Sigmoid())
        self.project = nn.Sequential(nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.depthwise(self.expand(x))
        y = self.project(y * self.se(y))
        return x + y if self.residual else y


class EfficientNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.blocks = nn.Sequential(MBConv(8, 8, 8, 3, 1), MBConv(8, 32, 12, 5, 2), MBConv(12, 48, 12, 3, 1))
        self.head = nn.Sequential(nn.Conv2d(12, 32, 1, bias=False), nn.BatchNorm2d(32), nn.SiLU())
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.head(self.blocks(self.stem(x))), 1)
        return self.classifier(torch.flatten(x, 1))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
        if mask is not None:
            scores = scores + mask
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, pre_norm, hidden=None):
        super().__init__()
        self.pre_norm = pre_norm
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden or 2 * d), nn.GELU(), nn.Linear(hidden or 2 * d, d))

    def forward(self, x, mask=None):
        if self.pre_norm:  # ViT
            x = x + self.attn(self.norm1(x), mask)
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x, mask))  # BERT
        return self.norm2(x + self.mlp(x))


class ViT(nn.Module):
    def __init__(self, image=16, patch=4, d=16, depth=2, heads=2, classes=10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.ModuleList(EncoderLayer(d, heads, True) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class Bert(nn.Module):
    def __init__(self, vocab=50, seq=8, d=16, depth=2, heads=2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(seq, d)
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, False) for _ in range(depth))
        self.pooler = nn.Linear(d, d)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        x = self.norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            x = layer(x, mask)
        return torch.tanh(self.pooler(x[:, 0]))


class TokenMLP(nn.Module):
    """A per-token MLP on [batch, tokens, features]: torch exports its Linears as MatMul + Add."""

    def __init__(self, d=8, hidden=16, classes=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return torch.tanh(self.fc2(F.relu(self.fc1(x))))


class ConvBnSiLU(nn.Module):
    def __init__(self, cin, cout, k=3, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.silu(self.bn(self.conv(x)))


class Yolo(nn.Module):
    """A YOLOv5-style detector: a strided Conv/BN/SiLU backbone, a nearest-upsample + Concat neck, two 1x1 heads
    whose grids are decoded into boxes (sigmoid, meshgrid offsets, anchor sizes) and scored without NMS:
    out[batch, boxes, 6] holds x1, y1, x2, y2, score, class."""

    def __init__(self, width=8, classes=3, anchors=((10, 13), (16, 30), (33, 23))):
        super().__init__()
        self.classes, self.anchors = classes, len(anchors)
        self.stem = ConvBnSiLU(3, width, 3, 2)
        self.down1 = ConvBnSiLU(width, 2 * width, 3, 2)
        self.down2 = ConvBnSiLU(2 * width, 4 * width, 3, 2)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.fuse = ConvBnSiLU(6 * width, 2 * width, 1)
        self.heads = nn.ModuleList(nn.Conv2d(c, len(anchors) * (5 + classes), 1) for c in (2 * width, 4 * width))
        self.register_buffer("anchor_grid", torch.tensor(anchors, dtype=torch.float32).view(1, -1, 1, 1, 2))

    def _decode(self, p, stride, scale):
        b, _, h, w = p.shape
        p = p.view(b, self.anchors, 5 + self.classes, h, w).permute(0, 1, 3, 4, 2).sigmoid()
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        grid = torch.stack((xs, ys), 2).view(1, 1, h, w, 2).float()
        xy, wh, conf = p.split((2, 2, 1 + self.classes), 4)
        xy = (xy * 2 - 0.5 + grid) * stride
        wh = (wh * 2) ** 2 * (self.anchor_grid * scale)
        return torch.cat((xy, wh, conf), 4).view(b, -1, 5 + self.classes)

    def forward(self, x):
        x = self.stem(x)
        small = self.down1(x)
        large = self.down2(small)
        small = self.fuse(torch.cat((self.up(large), small), 1))
        boxes = torch.cat((self._decode(self.heads[0](small), 4.0, 0.5),
                           self._decode(self.heads[1](large), 8.0, 1.0)), 1)
        xy, wh, obj, cls = boxes.split((2, 2, 1, self.classes), 2)
        score, label = (obj * cls).max(2, keepdim=True)
        return torch.cat((xy - wh / 2, xy + wh / 2, score, label.float()), 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in self.c_attn(x).split(d, 2))
        att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d // self.heads))
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class GPT2Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """A GPT-2-style decoder as Hugging Face builds it: learned positions, pre-norm blocks with a causal mask
    (`triu` + `masked_fill(-inf)`), tanh-approximated GELU, and an LM head tied to the token embedding."""

    def __init__(self, vocab=50, max_seq=16, d=16, depth=2, heads=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(GPT2Block(d, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Bottleneck(nn.Module):
    """ResNet-50's block (torchvision's v1.5: the stride on the 3x3 conv)."""

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.body(x) + self.downsample(x))


class ResNet50(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for stage, (width, depth) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            for i in range(depth):
                blocks.append(Bottleneck(cin, width, 2 if i == 0 and stage > 0 else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


# MobileNetV3-Large's blocks as the paper's table gives them: kernel, expansion, output, squeeze-excite, hard-swish,
# stride.
MOBILENETV3_LARGE = ((3, 16, 16, False, False, 1), (3, 64, 24, False, False, 2), (3, 72, 24, False, False, 1),
                     (5, 72, 40, True, False, 2), (5, 120, 40, True, False, 1), (5, 120, 40, True, False, 1),
                     (3, 240, 80, False, True, 2), (3, 200, 80, False, True, 1), (3, 184, 80, False, True, 1),
                     (3, 184, 80, False, True, 1), (3, 480, 112, True, True, 1), (3, 672, 112, True, True, 1),
                     (5, 672, 160, True, True, 2), (5, 960, 160, True, True, 1), (5, 960, 160, True, True, 1))


def _multiple_of_8(channels: int) -> int:
    """The nearest multiple of 8, rounded up where rounding to nearest loses over 10% (MobileNet's channel rule)."""
    rounded = max(8, (channels + 4) // 8 * 8)
    return rounded + 8 if rounded < 0.9 * channels else rounded


class MobileNetV3Large(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        blocks, cin = [], 16
        for kernel, expand, cout, se, hswish, stride in MOBILENETV3_LARGE:
            squeeze = _multiple_of_8(expand // 4) if se else 0
            blocks.append(InvertedResidual(cin, expand, cout, stride, kernel, squeeze,
                                           nn.Hardswish if hswish else nn.ReLU))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.last = nn.Sequential(nn.Conv2d(cin, 6 * cin, 1, bias=False), nn.BatchNorm2d(6 * cin), nn.Hardswish())
        self.head = nn.Sequential(nn.Linear(6 * cin, 1280), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1280, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.last(self.blocks(self.stem(x))), 1)
        return self.head(torch.flatten(x, 1))


def _calibrated(model: nn.Module, shape: tuple[int, ...], batches: int = 3) -> nn.Module:
    """`model` with its batch norms' running statistics measured on `batches` random inputs of `shape` (their
    mean), as training leaves them: with the defaults (mean 0, variance 1) a deep random net's activations shrink
    layer by layer in eval mode, and MobileNetV3-Large's outputs for two different inputs differed by 7e-9 of
    their 0.04, so a check of an engine's outputs against another's checked nothing."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average over the batches
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(shape))
    return model


def full_size() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]]:
    """The published sizes, as `zoo()` returns them (batch 1 examples): ResNet-50 and MobileNetV3-Large at 224x224
    (its batch norms calibrated, `_calibrated`), one BERT-base encoder layer (768 wide, 12 heads, 3072 hidden) over
    128 tokens."""
    torch.manual_seed(0)
    models = {"resnet50": (ResNet50(), (torch.randn(1, 3, 224, 224),), ["x"]),
              "mobilenetv3_large": (_calibrated(MobileNetV3Large(), (4, 3, 224, 224)),
                                    (torch.randn(1, 3, 224, 224),), ["x"]),
              "bert_base_layer": (EncoderLayer(768, 12, False, 3072), (torch.randn(1, 128, 768),), ["x"])}
    for model, _, _ in models.values():
        model.eval()
    return models


def zoo() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]]:
    """{name: (model in eval mode, example inputs at batch 2, input names)}, weights from torch's seed 0."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0
    models = {"token_mlp": (TokenMLP(), (torch.randn(2, 5, 8),), ["x"]),
              "resnet": (ResNet(), (torch.randn(2, 3, 32, 32),), ["x"]),
              "mobilenetv3": (MobileNetV3(), (torch.randn(2, 3, 32, 32),), ["x"]),
              "efficientnet": (EfficientNet(), (torch.randn(2, 3, 32, 32),), ["x"]),
              "vit": (ViT(), (torch.randn(2, 3, 16, 16),), ["x"]),
              "bert": (Bert(), (ids, mask), ["input_ids", "attention_mask"]),
              "yolo": (Yolo(), (torch.randn(2, 3, 64, 64),), ["x"]),
              "gpt2": (GPT2(), (torch.randint(0, 50, (2, 8)),), ["input_ids"])}
    for model, _, _ in models.values():
        model.eval()
    return models


DYNAMIC_AXES = {"gpt2": {0: "batch", 1: "seq"}}
"""Models whose inputs and output have run-time dims besides the batch (a decoder's sequence)."""


def export(model: nn.Module, inputs: tuple[torch.Tensor, ...], names: list[str], opset: int,
           axes: dict[int, str] | None = None) -> bytes:
    """The model as ONNX bytes from torch's TorchScript exporter, `axes` of every input and the output dynamic
    (default: the batch; the dynamo exporter needs onnxscript, which is not installed)."""
    import io
    import warnings

    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, f, opset_version=opset, input_names=names, output_names=["out"],
                          dynamic_axes={n: axes or {0: "batch"} for n in [*names, "out"]}, dynamo=False)
    return f.getvalue()
