"""TrivialAugmentWide on a batch on the device, each operation once for the whole batch.

The loader workers draw every image's operation and magnitude as the CPU path draws them
(:func:`datamodules.augment.trivial_augment_draw`); the device stage applies them here. torchvision's kernels take one
operation and one magnitude per call, and its geometric ones build their sampling matrix from Python numbers
(``torch.tensor(matrix, device=...)``): per image on a GPU, a blocking host-to-device copy each. Here each operation
is computed for the whole batch from the batch's operation and magnitude tensors, already on the device, and each image
keeps the result of the operation it drew (``torch.where``): the shear, translation and rotation share one sampling
grid (one matrix per image, one ``grid_sample``), the colour operations are per-image factors broadcast over the
batch. Nothing is read back to the host and no tensor is built from Python numbers per batch, so the stage never waits
for the step in flight. The arithmetic is torchvision's tensor kernels' (``_get_inverse_affine_matrix``,
``_affine_grid``, ``_blend``, ``adjust_sharpness_image``, ...), on uint8 values held in float:
``tests/unit/test_gpu_augment.py`` checks each operation against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.transforms.v2.functional import equalize

from datamodules.augment import trivial_augment

OPS = list(trivial_augment()._AUGMENTATION_SPACE)  # the index the workers draw is the position in this space
SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y, ROTATE = (
    OPS.index(name) for name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
)
if tuple(range(SHEAR_X, SHEAR_X + 5)) != (SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y, ROTATE):  # one range test below
    raise ImportError(f"torchvision's TrivialAugmentWide space changed its order: {OPS}")


def theta(op: torch.Tensor, magnitude: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[n, 2, 3]: each image's inverse affine matrix as torchvision's ``_get_inverse_affine_matrix`` makes it for the
    operation drawn (the identity for a non-geometric one): shears about the top-left corner (``center=[0, 0]``),
    translations by the magnitude truncated to whole pixels, rotations by ``-magnitude`` degrees about the centre."""
    zero = torch.zeros_like(magnitude)
    sx = torch.where(op == SHEAR_X, torch.atan(magnitude), zero)  # shear in degrees of atan(magnitude), in radians
    sy = torch.where(op == SHEAR_Y, torch.atan(magnitude), zero)
    rot = torch.where(op == ROTATE, torch.deg2rad(-magnitude), zero)  # rotate() passes -angle
    tx = torch.where(op == TRANSLATE_X, magnitude.trunc(), zero)  # translate=[int(magnitude), 0]
    ty = torch.where(op == TRANSLATE_Y, magnitude.trunc(), zero)
    corner = (op == SHEAR_X) | (op == SHEAR_Y)  # center=[0, 0]: relative to the image's centre
    cx, cy = torch.where(corner, zero - width * 0.5, zero), torch.where(corner, zero - height * 0.5, zero)
    a = torch.cos(rot - sy) / torch.cos(sy)
    b = -(a * torch.tan(sx) + torch.sin(rot))
    c = torch.sin(rot - sy) / torch.cos(sy)
    d = torch.cos(rot) - c * torch.tan(sx)
    m0, m1, m3, m4 = d, -b, -c, a
    m2 = cx - m0 * (cx + tx) - m1 * (cy + ty)
    m5 = cy - m3 * (cx + tx) - m4 * (cy + ty)
    return torch.stack([m0, m1, m2, m3, m4, m5], dim=-1).view(-1, 2, 3)


def sample(images: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """``images`` [n, C, H, W] resampled by ``matrices`` [n, 2, 3] as torchvision's ``_affine_grid`` and
    ``_apply_grid_transform`` do (bilinear, black outside, rounded as for uint8)."""
    n, _, height, width = images.shape
    base = torch.ones(1, height, width, 3, dtype=images.dtype, device=images.device)
    base[..., 0] = torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, width, device=images.device)
    base[..., 1] = torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, height, device=images.device)[:, None]
    rescaled = matrices.to(images.dtype).transpose(1, 2)
    rescaled = torch.cat([rescaled[..., :1] / (0.5 * width), rescaled[..., 1:] / (0.5 * height)], dim=-1)
    grid = base.view(1, height * width, 3).expand(n, -1, -1).bmm(rescaled).view(n, height, width, 2)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.round().clamp(0, 255)


def _blend(images: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend`` on uint8 images: clamped, then truncated to uint8."""
    return (images * factor + other * (1.0 - factor)).clamp(0, 255).floor()


def _gray(images: torch.Tensor) -> torch.Tensor:
    """``rgb_to_grayscale`` of uint8 images as ``adjust_saturation``/``adjust_contrast`` take it: floored."""
    r, g, b = images.unbind(dim=1)
    return (r * 0.2989 + g * 0.587 + b * 0.114).floor().unsqueeze(1)


def _sharpen(images: torch.Tensor, factor: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """``adjust_sharpness_image``: the interior blended with its 3x3 smoothing (rounded), the border kept."""
    blurred = F.conv2d(images, kernel, groups=images.shape[1]).round()
    inner = images[..., 1:-1, 1:-1]
    sharpened = F.pad(inner * factor + blurred * (1.0 - factor), (1, 1, 1, 1))
    border = torch.ones_like(images[:1, :1])
    border[..., 1:-1, 1:-1].fill_(0)  # fill_, not "= 0": that would copy a scalar tensor from the host
    return torch.where(border.bool(), images, sharpened).clamp(0, 255).floor()


def _autocontrast(images: torch.Tensor) -> torch.Tensor:
    """``autocontrast_image``: each channel stretched to 0..255 (a flat channel kept), truncated."""
    low, high = images.amin(dim=(-2, -1), keepdim=True), images.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    scale = torch.where(flat, torch.ones_like(high), (high - low) * (1.0 / 255.0))  # as torchvision: x 1/255
    return ((images - torch.where(flat, torch.zeros_like(low), low)) / scale).clamp(0, 255).floor()


def _posterize(images: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``posterize`` to ``int(bits)`` bits: the low ``8 - bits`` bits of each uint8 value cleared."""
    step = torch.exp2(8 - bits.trunc())
    return images - torch.remainder(images, step)


class BatchAugment:
    """TrivialAugmentWide's drawn operations applied to a batch on ``device`` (see the module's docstring)."""

    def __init__(self, device: torch.device) -> None:
        kernel = torch.ones(3, 1, 3, 3, device=device)  # adjust_sharpness's smoothing kernel, made on the device
        kernel[:, :, 1, 1].fill_(5.0)
        self.kernel = kernel / 13.0

    def __call__(self, images: torch.Tensor, op: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
        """``images`` float [n, H, W, 3] in pixel levels, each transformed by its drawn operation ``op`` [n] (-1: not
        augmented; those images pass as they are) with its ``magnitude`` [n]; the augmented ones are first rounded to
        uint8 levels, as the CPU path's crop hands them over."""
        op = op.to(torch.int64)
        m = magnitude.to(torch.float32)
        drawn = (op >= 0)[:, None, None, None]
        x = torch.where(drawn, images.round().clamp(0, 255), images).permute(0, 3, 1, 2)
        factor, level = (1.0 + m)[:, None, None, None], m[:, None, None, None]
        operations = {  # each computed for the whole batch, kept where drawn (one at a time: memory)
            "Brightness": lambda: (x * factor).clamp(0, 255).floor(),
            "Color": lambda: _blend(x, _gray(x), factor),
            "Contrast": lambda: _blend(x, _gray(x).mean(dim=(-3, -2, -1), keepdim=True), factor),
            "Sharpness": lambda: _sharpen(x, factor, self.kernel),
            "Posterize": lambda: _posterize(x, level),
            "Solarize": lambda: torch.where(x >= 255.0 * level, 255.0 - x, x),
            "AutoContrast": lambda: _autocontrast(x),
            "Equalize": lambda: equalize(x.clamp(0, 255).to(torch.uint8)).to(x.dtype),
        }
        geometric = (op >= SHEAR_X) & (op <= ROTATE)
        out = torch.where(geometric[:, None, None, None], sample(x, theta(op, m, x.shape[2], x.shape[3])), x)
        for name, operation in operations.items():
            out = torch.where((op == OPS.index(name))[:, None, None, None], operation(), out)
        return out.permute(0, 2, 3, 1)
