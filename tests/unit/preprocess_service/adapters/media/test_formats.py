"""Round trips per format and modality against direct decoding with the libraries themselves.

Every reference here is computed without our code: audio with soundfile and numpy (float64: an
FFT resampler, the STFT and Slaney's mel filters written out here from their definitions), images
with Pillow (exif_transpose, alpha over white, BICUBIC resize), the wire with protobuf.

Tolerances (measured on the pinned stack; see the constants):
  log-mel   both sides clamped at log(1e-5) before comparing, then |diff| <= 0.02. Below that floor
            a pure sine's mel bins hold only rounding noise of the resampler (power ~1e-9); above it
            the differences are float16 rounding (half an ulp is 0.0039 in [8, 16)) and the
            resamplers' (ours windowed-sinc, the reference's an exact FFT one, which rings where the
            clip starts and ends: resampled clips are compared away from their first and last
            EDGE_FRAMES frames, over the RESAMPLED_RANGE below their loudest bin, within
            RESAMPLED_ATOL). At 16 kHz, where nothing is resampled, every frame is compared.
  images    against Pillow's full decode + BICUBIC: RESIZE tier (only the resize kernels differ:
            torch's antialiased bicubic vs Pillow's) mean < 0.25, max <= 16, PSNR >= 55 dB, measured
            worst mean 0.096, max 2, PSNR 58.3 (an antialiased bilinear resize fails 16 of its 19
            cases); DCT tier (a JPEG decoded DCT-scaled by libjpeg-turbo first) mean < 2.0, max <= 32,
            PSNR >= 40 dB, measured worst mean 1.15, max 15, PSNR 44.0. No resize: PNG exact, JPEG
            max <= 2 and mean < 0.1 (measured 0: simplejpeg and Pillow both run libjpeg-turbo).
"""

import dataclasses
import functools
import io
import json

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image, ImageOps

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import wire
from disttrain_api.config import AudioConfig, GenerationConfig, ImageConfig
from disttrain_api.errors import SampleError
from helpers import jpeg_bytes
from preprocess_service.adapters.decode import DecodePool, InlineDecoder
from preprocess_service.adapters.media import audio, imaging
from preprocess_service.adapters.media.parse import parse_document
from preprocess_service.core.assemble import (
    MODALITY_AUDIO,
    MODALITY_GEN,
    MODALITY_IMAGE,
    MODALITY_PAD,
    MODALITY_TEXT,
    finish,
    layout_microbatch,
)
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.sample import AudioRef, GenImageRef, ImageRef, TextSegment
from preprocess_service.core.tokenizer import ByteTokenizer
from trainer.client import to_microbatch

TOK = ByteTokenizer()
ACFG = AudioConfig()
ICFG = ImageConfig()
GCFG = GenerationConfig()

LOGMEL_COMPARE_FLOOR = float(np.log(1e-5))
LOGMEL_ATOL = 0.02
PAD_FRAME_VALUE = np.float16(np.log(1e-10))

# --- audio -----------------------------------------------------------------------------------------

AUDIO_FORMATS = {  # name -> (soundfile format, subtype, member extension, lossless)
    "flac": ("FLAC", "PCM_16", "flac", True),
    "wav16": ("WAV", "PCM_16", "wav", True),
    "wav24": ("WAV", "PCM_24", "wav", True),
    "mp3": ("MP3", "MPEG_LAYER_III", "mp3", False),
    "ogg": ("OGG", "VORBIS", "ogg", False),
}

EDGE_FRAMES = 6
"""Frames (10 ms each) at either end of a resampled clip where the FFT reference's ringing lives."""
RESAMPLED_ATOL = 0.04
"""A resampled clip's tolerance: a windowed-sinc filter droops a little below its cutoff (a 3 kHz
tone from 8 kHz: 0.032 in log power, 0.7% in amplitude); the FFT reference does not."""
RESAMPLED_RANGE = float(np.log(10 ** 4.5))
"""A resampled clip is compared over the 45 dB below its loudest mel bin: further down lie the
images a windowed-sinc resampler leaves (about 50 dB down; the FFT reference leaves none)."""


def _slaney_hz_to_mel(hz):
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) * 27.0 / np.log(6.4), hz / (200.0 / 3))


def _slaney_mel_to_hz(mel):
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((mel - 15.0) * np.log(6.4) / 27.0), mel * (200.0 / 3))


def _reference_mel_power(wave: np.ndarray, rate=16000, n_fft=400, hop=160, n_mels=128) -> np.ndarray:
    """float64 [n_mels, frames]: Whisper's front end from its definition (centred reflect-padded
    STFT, periodic Hann window, power, Slaney-normalised Slaney-scale triangles)."""
    padded = np.pad(wave.astype(np.float64), n_fft // 2, mode="reflect")
    frames = 1 + (len(padded) - n_fft) // hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    stack = np.stack([padded[i * hop:i * hop + n_fft] * window for i in range(frames)])
    power = np.abs(np.fft.rfft(stack, axis=1)) ** 2  # [frames, n_fft // 2 + 1]
    bins = np.linspace(0, rate / 2, n_fft // 2 + 1)
    edges = _slaney_mel_to_hz(np.linspace(_slaney_hz_to_mel(0.0), _slaney_hz_to_mel(rate / 2), n_mels + 2))
    filters = np.zeros((n_mels, len(bins)))
    for m in range(n_mels):
        low, centre, high = edges[m], edges[m + 1], edges[m + 2]
        rising, falling = (bins - low) / (centre - low), (high - bins) / (high - centre)
        filters[m] = np.maximum(0, np.minimum(rising, falling)) * 2.0 / (high - low)
    return filters @ power.T


def _fft_resample(wave: np.ndarray, rate: int, new: int) -> np.ndarray:
    """Band-limited resampling by the FFT (exact for the clip's periodic extension)."""
    length = int(np.ceil(len(wave) * new / rate))
    spectrum = np.fft.rfft(wave.astype(np.float64))
    out = np.zeros(length // 2 + 1, dtype=complex)
    keep = min(len(spectrum), len(out))
    out[:keep] = spectrum[:keep]
    return np.fft.irfft(out, length) * (length / len(wave))


def _sine_clip(rate: int, channels: int, seconds: float, *, tones=((440.0, 1234.5), (660.0, 3000.0))) -> np.ndarray:
    """float32 [samples, channels]: two sines per channel, a different pair on each channel."""
    t = np.arange(int(round(rate * seconds))) / rate
    chans = [0.4 * np.sin(2 * np.pi * a * t) + 0.2 * np.sin(2 * np.pi * b * t) for a, b in tones[:channels]]
    return np.stack(chans, axis=1).astype(np.float32)


def _encode_audio(wave: np.ndarray, rate: int, name: str) -> bytes:
    fmt, subtype, _, _ = AUDIO_FORMATS[name]
    out = io.BytesIO()
    soundfile.write(out, wave, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def _reference_wave(data: bytes) -> tuple[np.ndarray, int, int]:
    """(mono float64 at 16 kHz, source rate, source frames) straight from soundfile + numpy."""
    wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = wave.astype(np.float64).mean(axis=1)
    resampled = mono if rate == 16000 else _fft_resample(mono, rate, 16000)
    return resampled, rate, wave.shape[0]


def _reference_log_mel(wave16k: np.ndarray) -> np.ndarray:
    """float32 [frames, 128] natural-log mel power of a 16 kHz mono waveform."""
    return np.log(np.maximum(_reference_mel_power(wave16k), 1e-10)).T.astype(np.float32)


def _logmel_diff(ours: np.ndarray, reference: np.ndarray, relative: bool = False) -> np.ndarray:
    """|diff| with both sides clamped at LOGMEL_COMPARE_FLOOR, or with ``relative`` at
    RESAMPLED_RANGE below the reference's loudest bin if that is higher (see the module docstring)."""
    floor = max(LOGMEL_COMPARE_FLOOR, float(reference.max()) - RESAMPLED_RANGE) if relative else LOGMEL_COMPARE_FLOOR
    return np.abs(np.maximum(ours.astype(np.float32), floor) - np.maximum(reference.astype(np.float32), floor))


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
@pytest.mark.parametrize("name", list(AUDIO_FORMATS))
def test_audio_log_mel_matches_a_soundfile_numpy_reference(name, rate, channels):
    seconds = 1.0 + 0.25 * channels  # 1.25 s mono, 1.5 s stereo
    written = _sine_clip(rate, channels, seconds)
    data = _encode_audio(written, rate, name)

    wave16k, read_rate, read_frames = _reference_wave(data)
    assert read_rate == rate
    true_seconds = read_frames / rate
    # The header alone tells the decoded length, for lossy formats too (encoder delay trimmed).
    assert audio.header_seconds(data) == pytest.approx(true_seconds, abs=1e-9)
    lossless = AUDIO_FORMATS[name][3]
    assert abs(true_seconds - len(written) / rate) <= (1e-9 if lossless else 0.05)

    frames = ACFG.num_tokens(audio.header_seconds(data)) * ACFG.token_stride
    ours = audio.decode_audio(data, ACFG, frames)
    assert ours.dtype == np.float16 and ours.shape == (frames, ACFG.n_mels)

    reference = _reference_log_mel(wave16k)
    assert reference.shape[0] >= frames  # a clip this long holds every planned frame: nothing padded
    inner = slice(EDGE_FRAMES, frames - EDGE_FRAMES) if rate != 16000 else slice(0, frames)
    diff = _logmel_diff(ours[inner], reference[:frames][inner], relative=rate != 16000)
    assert diff.max() <= (LOGMEL_ATOL if rate == 16000 else RESAMPLED_ATOL), \
        f"max {diff.max():.4f} at {np.unravel_index(diff.argmax(), diff.shape)}"
    assert diff.mean() < 0.005  # the resamplers' noise floors differ below the compare floor: not compared


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("name", ["flac", "wav16", "wav24", "ogg"])
def test_audio_at_16khz_is_the_float16_of_the_reference(name, channels):
    """No resampling: the same samples through the same mel definition, so only the float16 cast
    and float32 arithmetic differ, in every frame, the first and last too."""
    data = _encode_audio(_sine_clip(16000, channels, 1.0), 16000, name)
    frames = ACFG.num_tokens(audio.header_seconds(data)) * ACFG.token_stride
    reference = _reference_log_mel(_reference_wave(data)[0])[:frames]
    diff = _logmel_diff(audio.decode_audio(data, ACFG, frames), reference)
    assert diff.max() <= 0.01, f"max {diff.max():.4f} at {np.unravel_index(diff.argmax(), diff.shape)}"


def test_audio_longer_than_max_seconds_is_cut_to_its_first_max_seconds():
    cfg = AudioConfig(max_seconds=1.0)
    rate = 44100
    first = _sine_clip(rate, 2, 1.0)
    second = _sine_clip(rate, 2, 1.0, tones=((2500.0, 5000.0), (3700.0, 7000.0)))  # different content
    data = _encode_audio(np.concatenate([first, second]), rate, "flac")
    assert audio.header_seconds(data) == pytest.approx(2.0)

    frames = cfg.num_tokens(audio.header_seconds(data)) * cfg.token_stride
    assert frames == 100  # 1.0 s at 16 kHz / hop 160 = 100 frames = 25 tokens of 4
    ours = audio.decode_audio(data, cfg, frames)
    assert ours.shape == (100, 128) and ours.dtype == np.float16

    full16k = _reference_wave(data)[0]
    reference = _reference_log_mel(full16k[:16000])[:frames]  # first second only
    diff = _logmel_diff(ours, reference, relative=True)
    # Away from the ends (the reference's ringing, and the cut, where our resampler saw the input
    # end: it read max_seconds of it), every frame matches.
    assert diff[EDGE_FRAMES:-EDGE_FRAMES].max() <= RESAMPLED_ATOL


def test_json_durations_a_bit_off_still_give_exactly_the_planned_frames():
    one_second = _encode_audio(_sine_clip(22050, 1, 1.0), 22050, "flac")
    other = _encode_audio(_sine_clip(48000, 2, 1.0), 48000, "wav16")
    doc = parse_document({"__key__": "k", "flac": one_second, "1.wav": other,
                          "json": json.dumps({"durations": [1.3, 0.8]}).encode()},
                         image_config=ICFG, tokenizer=TOK, seq_len=4096, audio_config=ACFG)
    long_ref, short_ref = doc.audio
    assert (long_ref.member, long_ref.seconds, long_ref.frames) == ("flac", 1.3, 128)  # 130 frames -> 32 tokens
    assert (short_ref.member, short_ref.seconds, short_ref.frames) == ("1.wav", 0.8, 80)

    padded = audio.decode_audio(one_second, ACFG, long_ref.frames)
    assert padded.shape == (128, 128) and padded.dtype == np.float16
    reference = _reference_log_mel(_reference_wave(one_second)[0])
    assert reference.shape[0] == 101  # what the clip really holds
    inner = slice(EDGE_FRAMES, 101 - EDGE_FRAMES)  # 22.05 kHz: resampled (see the module docstring)
    assert _logmel_diff(padded[inner], reference[inner], relative=True).max() <= RESAMPLED_ATOL
    assert (padded[101:] == PAD_FRAME_VALUE).all()  # padding is the log floor, i.e. silence

    single = parse_document({"__key__": "k", "flac": one_second, "json": b'{"duration": 1.3}'},
                            image_config=ICFG, tokenizer=TOK, seq_len=4096, audio_config=ACFG)
    assert single.audio[0].frames == 128  # "duration" prices the first clip the same way

    cropped = audio.decode_audio(other, ACFG, short_ref.frames)
    assert cropped.shape == (80, 128)
    reference = _reference_log_mel(_reference_wave(other)[0])[:80]
    assert _logmel_diff(cropped[EDGE_FRAMES:], reference[EDGE_FRAMES:], relative=True).max() <= RESAMPLED_ATOL


# --- images ----------------------------------------------------------------------------------------

def _textured(width: int, height: int, *, seed: int = 0, alpha: bool = False) -> Image.Image:
    """An asymmetric, smooth-but-detailed RGB(A) test picture (every flip or turn changes it)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([127 + 100 * np.sin(x / 17.0 + seed), 127 + 100 * np.cos(y / 23.0),
                     127 + 90 * np.sin((x + y) / 31.0)], axis=-1)
    blobs = np.asarray(Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
                       .resize((width, height), Image.Resampling.BILINEAR)).astype(float)
    cells = rng.integers(0, 255, (height // 6 + 1, width // 6 + 1, 3)).astype(float)  # hard 6 px blocks:
    blocks = np.repeat(np.repeat(cells, 6, axis=0), 6, axis=1)[:height, :width]  # edges tell filters apart
    img = Image.fromarray(np.clip(0.5 * base + 0.35 * blobs + 0.15 * blocks, 0, 255).astype(np.uint8))
    if alpha:  # fully transparent top quarter, half transparent second quarter, a ramp below
        a = np.clip(x / width * 255, 0, 255).astype(np.uint8)
        a[: height // 4] = 0
        a[height // 4: height // 2] = 128
        img.putalpha(Image.fromarray(a))
    return img


def _save(img: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kwargs)
    return out.getvalue()


def _with_exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _pillow_displayed_rgb(data: bytes) -> Image.Image:
    """Pillow's own answer: EXIF transpose, then RGB with any transparency composited over white."""
    with Image.open(io.BytesIO(data)) as img:
        img = ImageOps.exif_transpose(img)
        if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
            rgba = img.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return img.convert("RGB")


def _pillow_reference(data: bytes, size_hw: tuple[int, int]) -> np.ndarray:
    img = _pillow_displayed_rgb(data)
    if img.size != (size_hw[1], size_hw[0]):
        img = img.resize((size_hw[1], size_hw[0]), Image.Resampling.BICUBIC)
    return np.asarray(img)


def _pillow_square_reference(data: bytes, size: int) -> np.ndarray:
    img = _pillow_displayed_rgb(data)
    width, height = img.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    img = img.crop((left, top, left + side, top + side))
    if side != size:
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(img)


def _stats(ours: np.ndarray, reference: np.ndarray) -> tuple[float, int, float]:
    """(mean |diff|, max |diff|, PSNR dB) of two uint8 images of one shape."""
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    diff = ours.astype(np.int32) - reference.astype(np.int32)
    mse = float(np.mean(diff.astype(np.float64) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
    return float(np.abs(diff).mean()), int(np.abs(diff).max()), psnr


# Tolerance tiers against Pillow (mean |diff| below, max |diff| at most, PSNR at least), see the
# module docstring: RESIZE when only the resize kernel differs (Pillow-decoded or JPEG decoded at full
# size), DCT when libjpeg-turbo decoded the JPEG scaled down before resizing.
RESIZE = (0.25, 16, 55.0)
DCT = (2.0, 32, 40.0)


def _assert_close(ours: np.ndarray, reference: np.ndarray, tier: tuple[float, int, float]) -> None:
    mean, peak, psnr = _stats(ours, reference)
    max_mean, max_peak, min_psnr = tier
    assert mean < max_mean and peak <= max_peak and psnr >= min_psnr, \
        f"mean {mean:.3f} max {peak} PSNR {psnr:.1f} dB, allowed mean < {max_mean} max <= {max_peak} PSNR >= {min_psnr}"


def _palette_with_transparency(img: Image.Image) -> bytes:
    return _save(img.convert("P", palette=Image.Palette.ADAPTIVE), "PNG", transparency=0)


@functools.cache
def _image_case(name: str) -> bytes:
    return IMAGE_CASES[name][0]()


IMAGE_CASES = {  # name -> (encoded bytes, tier of decode_image, tier of decode_square to 256)
    "jpeg_baseline": (lambda: _save(_textured(2400, 1600, seed=1), "JPEG", quality=90), DCT, DCT),
    "jpeg_progressive": (lambda: _save(_textured(2400, 1600, seed=2), "JPEG", quality=90, progressive=True),
                         DCT, DCT),
    "jpeg_grayscale": (lambda: _save(_textured(1000, 3000, seed=3).convert("L"), "JPEG", quality=90), DCT, DCT),
    "jpeg_cmyk": (lambda: _save(_textured(2000, 1200, seed=4).convert("CMYK"), "JPEG", quality=90), RESIZE, DCT),
    "jpeg_small_upscaled": (lambda: _save(_textured(300, 200, seed=5), "JPEG", quality=90), RESIZE, RESIZE),
    "png_rgb": (lambda: _save(_textured(900, 500, seed=6), "PNG"), RESIZE, RESIZE),
    "png_rgba": (lambda: _save(_textured(640, 480, seed=7, alpha=True), "PNG"), RESIZE, RESIZE),
    "png_palette": (lambda: _save(_textured(700, 500, seed=8).convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
                    RESIZE, RESIZE),
    "png_palette_transparency": (lambda: _palette_with_transparency(_textured(700, 500, seed=9)), RESIZE, RESIZE),
    "png_grayscale": (lambda: _save(_textured(640, 480, seed=10).convert("L"), "PNG"), RESIZE, RESIZE),
    "png_grayscale_alpha": (lambda: _save(_textured(640, 480, seed=11, alpha=True).convert("LA"), "PNG"),
                            RESIZE, RESIZE),
    "webp": (lambda: _save(_textured(1200, 700, seed=12), "WEBP", quality=90), RESIZE, RESIZE),
    "webp_rgba": (lambda: _save(_textured(640, 480, seed=13, alpha=True), "WEBP", quality=90), RESIZE, RESIZE),
}


@pytest.mark.parametrize("name", list(IMAGE_CASES))
def test_image_decode_matches_pillow_reference(name):
    data = _image_case(name)
    header = imaging.read_header(data)
    with Image.open(io.BytesIO(data)) as img:
        assert (header.width, header.height) == img.size
    size_hw = imaging.target_size(header.width, header.height, ICFG)
    assert size_hw != (header.height, header.width)  # this test is about the resized path

    ours = imaging.decode_image(data, size_hw, header.orientation)
    assert ours.dtype == np.uint8 and ours.shape == (*size_hw, 3)
    _assert_close(ours, _pillow_reference(data, size_hw), IMAGE_CASES[name][1])


@pytest.mark.parametrize("name", list(IMAGE_CASES))
def test_generation_square_matches_pillow_centre_crop_and_resize(name):
    data = _image_case(name)
    ours = imaging.decode_square(data, GCFG.image_size)
    assert ours.dtype == np.uint8 and ours.shape == (GCFG.image_size, GCFG.image_size, 3)
    _assert_close(ours, _pillow_square_reference(data, GCFG.image_size), IMAGE_CASES[name][2])


@pytest.mark.parametrize("mode,alpha", [("RGB", False), ("RGBA", True), ("P", False), ("P+tRNS", False),
                                        ("L", False), ("LA", True)])
def test_png_at_its_own_size_is_decoded_exactly(mode, alpha):
    img = _textured(448, 336, seed=20, alpha=alpha)  # both sides multiples of 28: target == source
    if mode == "P+tRNS":
        data = _palette_with_transparency(img)
    else:
        data = _save(img.convert(mode, palette=Image.Palette.ADAPTIVE) if mode == "P" else img.convert(mode), "PNG")
    assert imaging.target_size(448, 336, ICFG) == (336, 448)
    np.testing.assert_array_equal(imaging.decode_image(data, (336, 448)), _pillow_reference(data, (336, 448)))


@pytest.mark.parametrize("variant", ["baseline", "progressive", "grayscale", "cmyk", "444"])
def test_jpeg_at_its_own_size_matches_pillow_within_one_or_two_levels(variant):
    img = _textured(448, 336, seed=21)
    data = {"baseline": lambda: _save(img, "JPEG", quality=85),
            "progressive": lambda: _save(img, "JPEG", quality=85, progressive=True),
            "grayscale": lambda: _save(img.convert("L"), "JPEG", quality=85),
            "cmyk": lambda: _save(img.convert("CMYK"), "JPEG", quality=85),
            "444": lambda: _save(img, "JPEG", quality=85, subsampling=0)}[variant]()
    mean, peak, _ = _stats(imaging.decode_image(data, (336, 448)), _pillow_reference(data, (336, 448)))
    assert peak <= 2 and mean < 0.1, (mean, peak)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_jpeg_exif_orientation_matches_pillow_exif_transpose(orientation):
    swapped = orientation in (5, 6, 7, 8)
    # At its own size: no DCT scaling, no resize, so a wrong flip or turn cannot hide in the tolerance.
    small = _save(_textured(448, 336, seed=30 + orientation), "JPEG", quality=90, exif=_with_exif(orientation))
    header = imaging.read_header(small)
    assert header.orientation == orientation
    assert (header.height, header.width) == ((448, 336) if swapped else (336, 448))
    displayed_hw = (header.height, header.width)
    reference = _pillow_reference(small, displayed_hw)
    for ours in (imaging.decode_image(small, displayed_hw, orientation), imaging.decode_image(small, displayed_hw)):
        mean, peak, _ = _stats(ours, reference)
        assert peak <= 2 and mean < 0.1, (mean, peak)
    if orientation != 1:  # the check has teeth: the stored, un-oriented pixels are far off
        stored = np.asarray(Image.open(io.BytesIO(small)).convert("RGB").resize(displayed_hw[::-1]))
        assert _stats(stored, reference)[0] > 10

    # Large enough to be DCT-scaled and resized, and as a square generation target.
    big = _save(_textured(2400, 1600, seed=40 + orientation), "JPEG", quality=90, exif=_with_exif(orientation))
    header = imaging.read_header(big)
    size_hw = imaging.target_size(header.width, header.height, ICFG)
    assert (size_hw[0] > size_hw[1]) == swapped
    _assert_close(imaging.decode_image(big, size_hw, header.orientation), _pillow_reference(big, size_hw), DCT)
    _assert_close(imaging.decode_square(big, 256, header.orientation), _pillow_square_reference(big, 256), DCT)


def test_multi_picture_jpeg_exif_orientation_is_applied():
    buf = io.BytesIO()
    _textured(448, 336, seed=50).save(buf, "MPO", save_all=True, append_images=[_textured(448, 336, seed=51)],
                                      exif=_with_exif(6), quality=90)
    data = buf.getvalue()
    reference = _pillow_reference(data, (448, 336))  # exif_transpose: displayed portrait, 336 wide
    header = imaging.read_header(data)
    assert (header.width, header.height, header.orientation) == (336, 448, 6)
    assert _stats(imaging.decode_image(data, (448, 336)), reference)[1] <= 2


def test_jpeg_is_dct_scaled_by_a_power_of_two_as_documented():
    original = _textured(1600, 1000, seed=41)
    data = _save(original, "JPEG", quality=90)
    stored = imaging.decode_rgb(data, min_hw=(256, 256))
    assert stored.shape[:2] in {(1000 // s, 1600 // s) for s in (1, 2, 4, 8)}
    truth = np.asarray(original.crop((300, 0, 1300, 1000)).resize((256, 256), Image.Resampling.BICUBIC))
    pillow_psnr = _stats(_pillow_square_reference(data, 256), truth)[2]
    assert _stats(imaging.decode_square(data, 256), truth)[2] >= pillow_psnr - 3


# --- parsing and layout ----------------------------------------------------------------------------

SEQ_LEN = 1024


def _flac(seconds: float, rate: int = 44100, channels: int = 2) -> bytes:
    return _encode_audio(_sine_clip(rate, channels, seconds), rate, "flac")


def _interleaved_sample(key: str, order=("txt", "jpg", "1.txt", "flac", "1.jpg"), **json_fields) -> dict:
    """txt, 1.txt, jpg, 1.jpg (EXIF-rotated) and a 1 s FLAC; JSON "order" unless None, plus json_fields."""
    meta = {**({"order": list(order)} if order is not None else {}), **json_fields}
    return {"__key__": key, "__url__": "mem.tar",
            "txt": b"first text", "1.txt": "second text, h\u00e9".encode(),
            "jpg": jpeg_bytes(280, 224, seed=1), "1.jpg": jpeg_bytes(336, 168, seed=2, exif_orientation=8),
            "flac": _flac(1.0), "json": json.dumps(meta).encode()}


def _parse(sample: dict):
    return parse_document(sample, image_config=ICFG, tokenizer=TOK, seq_len=SEQ_LEN, audio_config=ACFG,
                          generation=GCFG)


def _runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    edges = [0, *(np.flatnonzero(np.diff(values)) + 1).tolist(), len(values)]
    return [(int(values[a]), a, b) for a, b in zip(edges, edges[1:])]


def _direct_decode(segment, data: bytes) -> np.ndarray:
    if isinstance(segment, ImageRef):
        return imaging.decode_image(data, (segment.height, segment.width), segment.orientation)
    if isinstance(segment, AudioRef):
        return audio.decode_audio(data, ACFG, segment.frames)
    return imaging.decode_square(data, segment.size, segment.orientation)


def test_json_order_gives_segments_in_exactly_that_order():
    doc = _parse(_interleaved_sample("a"))
    assert [s.member for s in doc.segments] == ["txt", "jpg", "1.txt", "flac", "1.jpg"]
    assert [type(s) for s in doc.segments] == [TextSegment, ImageRef, TextSegment, AudioRef, ImageRef]
    assert doc.segments[4].orientation == 8 and (doc.segments[4].height, doc.segments[4].width) == (336, 168)
    assert doc.segments[3].frames == 100 and doc.segments[3].tokens == 25  # 1 s priced from the FLAC header


def test_members_the_order_leaves_out_follow_in_default_order():
    doc = _parse(_interleaved_sample("a", order=("1.txt", "flac")))
    assert [s.member for s in doc.segments] == ["1.txt", "flac", "jpg", "1.jpg", "txt"]


def test_without_order_segments_default_to_images_then_audio_then_texts():
    sample = {"__key__": "b", "1.txt": b"later", "txt": b"caption", "1.flac": _flac(0.5),
              "wav": _encode_audio(_sine_clip(16000, 1, 0.5), 16000, "wav16"),
              "2.png": jpeg_bytes(56, 56, fmt="PNG"), "1.jpg": jpeg_bytes(84, 56),
              "webp": jpeg_bytes(56, 84, fmt="WEBP")}
    doc = _parse(sample)
    assert [s.member for s in doc.segments] == ["webp", "1.jpg", "2.png", "wav", "1.flac", "txt", "1.txt"]


def test_generate_makes_that_image_a_gen_segment_of_query_tokens():
    doc = _parse(_interleaved_sample("c", generate=["1.jpg"]))
    gen = doc.segments[4]
    assert isinstance(gen, GenImageRef) and gen.member == "1.jpg"
    assert gen.tokens == GCFG.query_tokens and gen.size == GCFG.image_size and gen.orientation == 8
    assert isinstance(doc.segments[1], ImageRef)  # the other image still goes to the encoder
    out = imaging.decode_square(doc.media_bytes["1.jpg"], gen.size, gen.orientation)
    assert out.shape == (GCFG.image_size, GCFG.image_size, 3) and out.dtype == np.uint8


def test_audio_without_json_duration_is_priced_from_its_header():
    clip = _encode_audio(_sine_clip(22050, 1, 1.7), 22050, "wav16")
    doc = _parse({"__key__": "d", "wav": clip, "txt": b"x"})
    (ref,) = doc.audio
    assert ref.seconds == soundfile.info(io.BytesIO(clip)).duration == 37485 / 22050
    assert ref.tokens == ACFG.num_tokens(ref.seconds) == 42 and ref.frames == 168


@pytest.mark.parametrize("fields", [
    {"order": ["txt", "2.jpg"]},  # a member the sample does not hold
    {"order": ["txt", "jpg", "txt"]},  # a member twice
    {"order": "txt jpg"},  # not a list
    {"order": ["txt", 1]},  # not names
    {"generate": ["flac"]},  # not an image
    {"generate": ["5.png"]},  # not a member
    {"generate": "jpg"},  # not a list
])
def test_bad_order_or_generate_raises_invalid_order(fields):
    sample = _interleaved_sample("e", order=None)
    sample["json"] = json.dumps(fields).encode()
    with pytest.raises(SampleError) as info:
        _parse(sample)
    assert info.value.kind == "invalid_order" and info.value.key == "e" and info.value.shard == "mem.tar"


def test_unhashable_generate_entries_raise_sample_error():
    with pytest.raises(SampleError):
        _parse(_interleaved_sample("e", order=None, generate=[["jpg"]]))


def test_garbage_audio_without_json_duration_raises_unreadable_audio():
    with pytest.raises(SampleError) as info:
        _parse({"__key__": "f", "flac": b"fLaC but not really" * 20, "txt": b"x"})
    assert info.value.kind == "unreadable_audio"


def test_garbage_audio_with_json_duration_is_planned_and_fails_only_at_decode():
    doc = _parse({"__key__": "f", "flac": b"garbage" * 20, "txt": b"x", "json": b'{"duration": 2.0}'})
    assert doc.audio[0].frames == 200
    with pytest.raises(Exception):  # noqa: B017 (libsndfile's own error type: any failure at decode will do)
        audio.decode_audio(doc.media_bytes["flac"], ACFG, 200)


def _mixed_documents():
    """Three documents: interleaved with JSON order, default order, and one with a generation target."""
    a = _parse(_interleaved_sample("a"))
    b = _parse({"__key__": "b", "txt": b"only caption", "wav": _encode_audio(_sine_clip(8000, 1, 0.6), 8000, "wav16"),
                "png": _save(_textured(300, 200, seed=60, alpha=True), "PNG")})
    c = _parse(_interleaved_sample("c", order=("1.jpg", "txt", "jpg", "1.txt", "flac"), generate=["1.jpg"]))
    return a, b, c


def _mixed_layout(docs=None):
    a, b, c = docs or _mixed_documents()
    sequences = [PackedSequence(seq_len=SEQ_LEN, documents=[a, b]), PackedSequence(seq_len=SEQ_LEN, documents=[c])]
    return layout_microbatch(sequences, seq_len=SEQ_LEN, tokenizer=TOK, audio_config=ACFG)


_MODALITY_OF = {TextSegment: MODALITY_TEXT, ImageRef: MODALITY_IMAGE, AudioRef: MODALITY_AUDIO,
                GenImageRef: MODALITY_GEN}


def test_layout_puts_modalities_spans_and_decoded_media_in_segment_order():
    docs = _mixed_documents()
    a, b, c = docs
    assert [type(s) for s in b.segments] == [ImageRef, AudioRef, TextSegment]
    assert [type(s) for s in c.segments] == [GenImageRef, TextSegment, ImageRef, TextSegment, AudioRef]
    layout = _mixed_layout(docs)
    decoded = InlineDecoder().submit(layout).result()
    assert decoded.errors == {}
    arrays = finish(layout, decoded.buffer).arrays
    assert layout.sample_keys == ["a", "b", "c"]

    tokens, modality = arrays["tokens"], arrays["modality"]
    assert tokens.shape == modality.shape == (2, SEQ_LEN) and tokens.dtype == np.int32 and modality.dtype == np.uint8
    flat_modality, flat_tokens = modality.reshape(-1), tokens.reshape(-1)
    spans = {MODALITY_IMAGE: [], MODALITY_AUDIO: [], MODALITY_GEN: []}
    expected_media = {MODALITY_IMAGE: [], MODALITY_AUDIO: [], MODALITY_GEN: []}
    for row, row_docs in ((0, [a, b]), (1, [c])):
        runs = _runs(modality[row])
        position = row * SEQ_LEN
        for doc in row_docs:
            # BOS, then one run per segment (adjacent texts would merge, but none are adjacent here), EOS.
            expected = [(MODALITY_TEXT, 1)] + [(_MODALITY_OF[type(s)], s.tokens) for s in doc.segments]
            starts = position
            assert tokens[row, position - row * SEQ_LEN] == TOK.bos_id
            position += 1
            for segment, (mod, length) in zip(doc.segments, expected[1:]):
                if isinstance(segment, TextSegment):
                    np.testing.assert_array_equal(flat_tokens[position:position + length], segment.ids)
                else:
                    spans[mod].append((position, position + length))
                    expected_media[mod].append(_direct_decode(segment, doc.media_bytes[segment.member]))
                    placeholder = {MODALITY_IMAGE: TOK.image_id, MODALITY_AUDIO: TOK.audio_id,
                                   MODALITY_GEN: TOK.gen_id}[mod]
                    assert (flat_tokens[position:position + length] == placeholder).all()
                assert (flat_modality[position:position + length] == mod).all()
                position += length
            assert flat_tokens[position] == TOK.eos_id and flat_modality[position] == MODALITY_TEXT
            position += 1
            np.testing.assert_array_equal(arrays["position_ids"].reshape(-1)[starts:position],
                                          np.arange(position - starts))
        assert (flat_modality[position:(row + 1) * SEQ_LEN] == MODALITY_PAD).all()
        assert (flat_tokens[position:(row + 1) * SEQ_LEN] == TOK.pad_id).all()
        assert runs[-1][0] == MODALITY_PAD

    ends = np.cumsum([a.num_tokens, b.num_tokens])
    np.testing.assert_array_equal(arrays["cu_seqlens"], [0, *ends, SEQ_LEN, SEQ_LEN + c.num_tokens, 2 * SEQ_LEN])
    np.testing.assert_array_equal(arrays["segment_doc"], [0, 1, -1, 2, -1])

    # Modality ids in exactly the segment order of document a (JSON order) as runs of the token array.
    a_runs = [(m, e - s) for m, s, e in _runs(modality[0][:a.num_tokens])]
    assert a_runs == [(1, 1 + 10), (2, 80), (1, len("second text, h\u00e9".encode())), (3, 25), (2, 72), (1, 1)]

    np.testing.assert_array_equal(arrays["image_spans"], np.array(spans[MODALITY_IMAGE], dtype=np.int32))
    np.testing.assert_array_equal(arrays["audio_spans"], np.array(spans[MODALITY_AUDIO], dtype=np.int32))
    np.testing.assert_array_equal(arrays["gen_spans"], np.array(spans[MODALITY_GEN], dtype=np.int32))
    assert len(spans[MODALITY_IMAGE]) == 4 and len(spans[MODALITY_AUDIO]) == 3 and len(spans[MODALITY_GEN]) == 1

    # pixels / mel / gen_pixels hold exactly what direct decode_* calls give, in span order.
    images = expected_media[MODALITY_IMAGE]
    np.testing.assert_array_equal(arrays["image_shapes"], np.array([im.shape for im in images], dtype=np.int32))
    assert arrays["pixels"].dtype == np.uint8
    np.testing.assert_array_equal(arrays["pixels"], np.concatenate([im.reshape(-1) for im in images]))
    mels = expected_media[MODALITY_AUDIO]
    np.testing.assert_array_equal(arrays["audio_frames"], np.array([m.shape[0] for m in mels], dtype=np.int32))
    assert arrays["mel"].dtype == np.float16 and arrays["mel"].shape == (sum(m.shape[0] for m in mels), 128)
    np.testing.assert_array_equal(arrays["mel"], np.concatenate(mels))
    assert arrays["gen_pixels"].shape == (1, 256, 256, 3) and arrays["gen_pixels"].dtype == np.uint8
    np.testing.assert_array_equal(arrays["gen_pixels"][0], expected_media[MODALITY_GEN][0])


# --- wire ------------------------------------------------------------------------------------------

def _wire_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    f16 = rng.standard_normal((5, 7)).astype(np.float16)
    f16[0, :3] = [np.nan, np.inf, -0.0]
    f32 = rng.standard_normal((3, 4, 2)).astype(np.float32)
    f32[0, 0, 0] = -np.inf
    return {
        "u8": rng.integers(0, 256, (4, 5, 3), dtype=np.uint8),
        "i16": np.array([-32768, -1, 0, 1, 32767], dtype=np.int16),
        "i32": rng.integers(-2**31, 2**31, (2, 3), dtype=np.int32),
        "i64": np.array([[-2**63, 2**63 - 1], [0, 1 << 40]], dtype=np.int64),
        "f16": f16,
        "f32": f32,
        "empty_u8": np.zeros((0,), dtype=np.uint8),
        "empty_i16": np.zeros((0, 2), dtype=np.int16),
        "empty_i32": np.zeros((0, 2), dtype=np.int32),
        "empty_i64": np.zeros((3, 0), dtype=np.int64),
        "empty_f16": np.zeros((0, 128), dtype=np.float16),
        "empty_gen": np.zeros((0, 0, 0, 3), dtype=np.uint8),
        "empty_f32": np.zeros((0,), dtype=np.float32),
        "scalar_i32": np.array(-5, dtype=np.int32),
        "strided_f32": np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],  # not contiguous
        "transposed_u8": np.arange(12, dtype=np.uint8).reshape(3, 4).T,
        "last_empty": np.zeros((0,), dtype=np.float16),  # an empty tensor as the message's last bytes
    }


def _wire_header() -> pb.Microbatch:
    return pb.Microbatch(job_id="job-1", step=12, dp_rank=3, microbatch_index=1, num_microbatches=4, epoch=2,
                         sample_keys=["k1", "k\u00e9y2"],
                         sequence_costs=[pb.SequenceCost(encoder_s=0.5, backbone_s=1.0, generator_s=0.25, total_s=2.5)],
                         skipped=[pb.SkippedSample(key="bad", shard="s.tar", reason="garbage", kind="decode_failed")])


def _protobuf_built(header: pb.Microbatch, arrays: dict[str, np.ndarray]) -> pb.Microbatch:
    message = pb.Microbatch()
    message.CopyFrom(header)
    message.tensors.extend(wire.to_tensor(name, array) for name, array in arrays.items())
    return message


def _same_array(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()  # NaN and -0.0 too


def test_encode_microbatch_parses_into_the_message_protobuf_builds():
    header, arrays = _wire_header(), _wire_arrays()
    raw = wire.encode_microbatch(header, arrays)
    parsed = pb.Microbatch.FromString(raw)
    assert parsed == _protobuf_built(header, arrays)
    for tensor, (name, array) in zip(parsed.tensors, arrays.items()):
        assert tensor.name == name and list(tensor.shape) == list(array.shape)
        _same_array(wire.from_tensor(tensor), array)


@pytest.mark.parametrize("producer", ["ours", "protobuf"])
def test_decode_microbatch_round_trips_names_dtypes_shapes_and_values(producer):
    header, arrays = _wire_header(), _wire_arrays()
    raw = (wire.encode_microbatch(header, arrays) if producer == "ours"
           else _protobuf_built(header, arrays).SerializeToString())
    message, decoded = wire.decode_microbatch(raw)
    assert message == header and len(message.tensors) == 0
    assert list(decoded) == list(arrays)
    for name, array in arrays.items():
        _same_array(decoded[name], array)


def test_wire_rejects_dtypes_it_does_not_carry():
    for array in (np.zeros(3, dtype=np.float64), np.zeros(3, dtype=bool), np.zeros(3, dtype=">i4")):
        with pytest.raises(ValueError, match="dtype"):
            wire.encode_microbatch(pb.Microbatch(), {"x": array})
        with pytest.raises(ValueError, match="dtype"):
            wire.to_tensor("x", array)


def test_to_microbatch_gives_writable_tensors_with_images_and_mels_split():
    layout = _mixed_layout()
    decoded = InlineDecoder().submit(layout).result()
    arrays = finish(layout, decoded.buffer).arrays
    header = pb.Microbatch(job_id="j", step=3, microbatch_index=1, num_microbatches=2, epoch=1,
                           sample_keys=layout.sample_keys)
    mb = to_microbatch(wire.encode_microbatch(header, arrays))
    assert (mb.step, mb.epoch, mb.microbatch_index, mb.num_microbatches) == (3, 1, 1, 2)
    assert mb.sample_keys == ["a", "b", "c"]
    for name in ("tokens", "position_ids", "modality", "cu_seqlens", "segment_doc", "image_spans",
                 "audio_spans", "gen_spans"):
        np.testing.assert_array_equal(getattr(mb, name).numpy(), arrays[name])
    assert mb.gen_images.dtype == torch.uint8 and mb.gen_images.shape == (1, 256, 256, 3)
    np.testing.assert_array_equal(mb.gen_images.numpy(), arrays["gen_pixels"])

    shapes = arrays["image_shapes"].tolist()
    assert [list(im.shape) for im in mb.images] == shapes and all(im.dtype == torch.uint8 for im in mb.images)
    offsets = np.cumsum([0] + [h * w * c for h, w, c in shapes])
    for image, start, end, shape in zip(mb.images, offsets, offsets[1:], shapes):
        np.testing.assert_array_equal(image.numpy(), arrays["pixels"][start:end].reshape(shape))
    frames = arrays["audio_frames"].tolist()
    assert [m.shape[0] for m in mb.mels] == frames and all(m.dtype == torch.float16 for m in mb.mels)
    np.testing.assert_array_equal(torch.cat(mb.mels).numpy(), arrays["mel"])

    for tensor in (mb.tokens, mb.images[0], mb.mels[0], mb.gen_images):  # writable, own memory
        assert tensor.numpy().flags.writeable
        tensor.view(-1)[0] = tensor.view(-1)[0]  # would raise on a read-only buffer
    mb.tokens[0, 0] += 1
    assert arrays["tokens"][0, 0] == TOK.bos_id


def test_to_microbatch_without_any_media():
    doc = _parse({"__key__": "t", "txt": b"just text"})
    layout = layout_microbatch([PackedSequence(seq_len=64, documents=[doc])], seq_len=64, tokenizer=TOK,
                               audio_config=ACFG)
    arrays = finish(layout, InlineDecoder().submit(layout).result().buffer).arrays
    mb = to_microbatch(wire.encode_microbatch(pb.Microbatch(sample_keys=["t"]), arrays))
    assert mb.images == [] and mb.mels == [] and tuple(mb.gen_images.shape) == (0, 0, 0, 3)
    assert tuple(mb.image_spans.shape) == (0, 2) and tuple(mb.audio_spans.shape) == (0, 2)


# --- decode pool -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool2():
    pool = DecodePool(2)
    try:
        yield pool
    finally:
        pool.close()


def test_decode_pool_output_does_not_depend_on_the_number_of_workers(pool2):
    layout = _mixed_layout()
    inline = InlineDecoder(num_threads=3).submit(layout).result()
    assert inline.errors == {}
    pool1 = DecodePool(1)
    try:
        for pool in (pool1, pool2):
            result = pool.submit(layout).result(timeout=60)
            try:
                assert result.errors == {}
                if pool is pool1:  # a fresh arena: even the alignment padding is the same (zero)
                    assert result.buffer.tobytes() == inline.buffer.tobytes()
                ours, reference = layout.media_arrays(result.buffer), layout.media_arrays(inline.buffer)
                for name in ("pixels", "mel", "gen_pixels"):
                    assert ours[name].tobytes() == reference[name].tobytes()
            finally:
                result.release()
    finally:
        pool1.close()


def test_decode_pool_reports_a_document_with_garbage_bytes_and_decodes_the_rest(pool2):
    a, b, c = _mixed_documents()
    bad_image = dataclasses.replace(b, media_bytes={**b.media_bytes, "png": b"\x89PNG garbage" * 30})
    bad_audio = dataclasses.replace(a, key="a-bad", media_bytes={**a.media_bytes, "flac": b"fLaC garbage" * 30})
    good = _mixed_layout((a, b, c))
    layout = layout_microbatch([PackedSequence(seq_len=SEQ_LEN, documents=[a, bad_image]),
                                PackedSequence(seq_len=SEQ_LEN, documents=[c]),
                                PackedSequence(seq_len=SEQ_LEN, documents=[bad_audio])],
                               seq_len=SEQ_LEN, tokenizer=TOK, audio_config=ACFG)
    expected = InlineDecoder().submit(good).result().buffer
    for decoder in (pool2, InlineDecoder()):
        result = decoder.submit(layout).result(timeout=60)
        try:
            assert set(result.errors) == {"b", "a-bad"} and all(result.errors.values())
            good_items = {doc.key: items for doc, items in good.documents}
            for doc, items in layout.documents:
                if doc.key in result.errors:
                    continue
                for item, reference in zip(items, good_items[doc.key], strict=True):
                    assert result.buffer[item.offset:item.offset + item.nbytes].tobytes() == \
                        expected[reference.offset:reference.offset + reference.nbytes].tobytes()
        finally:
            result.release()


def test_audio_decodes_where_torchaudio_cannot_be_imported():
    """The service needs no torchaudio (its wheels pin one torch build each): with its import
    blocked, a clip still decodes to the same frames."""
    import subprocess
    import sys

    data = _encode_audio(_sine_clip(44100, 2, 1.0), 44100, "flac")
    frames = ACFG.num_tokens(audio.header_seconds(data)) * ACFG.token_stride
    code = ("import sys, numpy as np; sys.modules['torchaudio'] = None\n"
            "from disttrain_api.config import AudioConfig\n"
            "from preprocess_service.adapters.media import audio\n"
            f"out = audio.decode_audio(sys.stdin.buffer.read(), AudioConfig(), {frames})\n"
            "sys.stdout.buffer.write(out.tobytes())")
    done = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = np.frombuffer(done.stdout, dtype=np.float16).reshape(frames, ACFG.n_mels)
    np.testing.assert_array_equal(got, audio.decode_audio(data, ACFG, frames))
