"""The decoders on real photos: TorchCodec for JPEGs, PIL for the rest and for refused files, reduced-size decoding."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

from datamodules.decode import decode, decode_for, min_side_for
from datamodules.imagenet import ImageNetDataModule, classic_transforms
from tests.unit.test_imagenet import photos  # noqa: F401  (the real-photo ImageFolder fixture)
from tools.photos import photo_sources


def _jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def rocket() -> Image.Image:
    return Image.open(photo_sources()["rocket"][0]).convert("RGB")  # 640x427


def test_jpeg_through_torchcodec_matches_pil_and_other_formats_and_refused_files_go_to_pil(rocket):
    data = _jpeg(rocket)
    fast = decode(data)
    assert isinstance(fast, torch.Tensor) and fast.dtype == torch.uint8 and fast.shape == (3, 427, 640)
    reference = pil_to_tensor(decode(data, "pil"))
    # both are libjpeg-turbo: the same pixels up to the IDCT's rounding
    assert (fast.int() - reference.int()).abs().float().mean() < 1.0
    png = io.BytesIO()
    rocket.save(png, "PNG")
    assert isinstance(decode(png.getvalue()), Image.Image)  # not a JPEG: PIL
    grey = decode(_jpeg(rocket.convert("L")))
    assert grey.shape == (3, 427, 640)  # greyscale JPEGs come out RGB as well
    with pytest.raises(OSError):  # truncated: TorchCodec refuses, PIL raises the error the datasets report
        decode(data[:300])


def test_reduced_size_decoding_keeps_what_the_transform_needs(rocket):
    big = _jpeg(rocket.resize((2560, 1708)))
    evaluation = min_side_for(224, train=False)
    assert evaluation == 256
    small = decode(big, min_side=evaluation)
    # DCT scaling by 1/4: 640x427, the shorter side still above the 256 the evaluation resize needs
    assert isinstance(small, Image.Image) and small.size == (640, 427)
    training = min_side_for(224, train=True)  # the smallest RandomResizedCrop must not be upscaled
    assert training == 915
    assert decode(big, min_side=training).shape == (3, 1708, 2560)  # training needs more than half of 1708
    huge = _jpeg(rocket.resize((3840, 2562)))
    assert decode(huge, min_side=training).size == (1920, 1281)  # half of it still gives the smallest crop 313 px
    assert decode(big).shape == (3, 1708, 2560)  # no min_side: full size
    assert decode(_jpeg(rocket), min_side=evaluation).shape == (3, 427, 640)  # not 2x larger: full size, TorchCodec


def _both_ways(data: bytes, transform, seed: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The training transform after decoding whole, and after ``decode_for`` (crop while decoding), from the same
    seed; and whether both consumed the same random numbers (the next draw agrees)."""
    torch.manual_seed(seed)
    first = transform(decode(data))
    after_first = torch.rand(1)
    torch.manual_seed(seed)
    image, rest = decode_for(data, transform)
    second = rest(image)
    return first, second, bool(torch.equal(after_first, torch.rand(1)))


def test_training_crop_drawn_before_decoding_gives_the_same_crops_and_decodes_large_boxes_reduced(rocket):
    transform = classic_transforms(224, train=True, uint8=True)
    # ImageNet-sized (~500x375): no box is twice 224 px, so every crop is decoded whole, pixel for pixel the same
    small = _jpeg(rocket.resize((500, 334)))
    for seed in range(8):
        first, second, same_draws = _both_ways(small, transform, seed)
        assert torch.equal(first, second) and same_draws, seed
    # 1280x854: boxes of 448 px or more are decoded at 1/2 (not the same pixels), the others whole; every output is
    # the same crop and flip (a wrong box or a missed flip differs by far more than the DCT scaling's rounding)
    large = _jpeg(rocket.resize((1280, 854)))
    reduced = 0
    for seed in range(8):
        first, second, same_draws = _both_ways(large, transform, seed)
        assert same_draws and second.shape == first.shape == (3, 224, 224), seed
        difference = (first.float() - second.float()).abs().mean().item()
        assert difference < 4.0, (seed, difference)
        reduced += difference > 0
    assert 0 < reduced < 8
    # a JPEG whose EXIF orientation TorchCodec applies: decoded whole first, as before
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    rocket.resize((1280, 854)).save(buffer, "JPEG", quality=90, exif=exif.tobytes())
    first, second, same_draws = _both_ways(buffer.getvalue(), transform, 0)
    assert torch.equal(first, second) and same_draws


def test_folder_pipeline_prints_no_deprecation_warning(photos):  # noqa: F811
    dm = ImageNetDataModule(data_dir=str(photos), batch_size=9, num_workers=0, image_size=32)
    dm.setup("validate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        images, labels = next(iter(dm.val_dataloader()))
    assert images.shape == (9, 3, 32, 32) and len(labels) == 9
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning | UserWarning)], caught
