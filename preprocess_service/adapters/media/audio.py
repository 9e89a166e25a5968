"""Audio: duration from metadata or header (planning), and decode -> mono -> resample -> log-mel.

Decoding goes through soundfile (libsndfile: WAV 8/16/24/32-bit and float, FLAC, OGG/Vorbis and
Opus, MP3); resampling and the mel filterbank are torch operations here (Whisper's front end:
torchaudio's windowed-sinc resampler and Slaney mel scale, without torchaudio, whose wheels pin
one torch build each and so could not install beside a user's torch). The
frame count is fixed at planning (``AudioConfig.num_tokens``): the decoded mel is cropped or
padded (with the log floor, i.e. silence) to exactly that, so a clip whose JSON duration is a
little off still delivers the planned size.
"""

from __future__ import annotations

import functools
import io
import math
from typing import TYPE_CHECKING

import numpy as np
import soundfile

from disttrain_api.config import AudioConfig

if TYPE_CHECKING:
    import torch

AUDIO_EXTENSIONS = ("flac", "wav", "mp3", "ogg")
LOG_FLOOR = 1e-10
"""Power below which the log-mel is clamped; padding frames hold log(LOG_FLOOR)."""


MIN_SOURCE_RATE, MAX_SOURCE_RATE = 1000, 384_000
MAX_AMPLITUDE = 1e4
"""Float audio is nominally in [-1, 1]; far beyond that the file is corrupt (and its mel overflows)."""
MAX_CHANNELS = 64
MAX_RESAMPLE_PHASES = 1 << 22
"""Bound on (source rate / g) * (target rate / g), g their gcd: the resampling kernel has that many
taps. 44.1 kHz -> 16 kHz is 441 * 160; a prime rate such as 44101 Hz would need a kernel of
gigabytes, so a header declaring one makes the clip unreadable rather than the worker explode."""


def check_header(rate: int, channels: int, target_rate: int) -> None:
    """ValueError for header values that cannot be decoded within bounds."""
    if not MIN_SOURCE_RATE <= rate <= MAX_SOURCE_RATE:
        raise ValueError(f"audio header declares {rate} Hz, outside [{MIN_SOURCE_RATE}, {MAX_SOURCE_RATE}]")
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"audio header declares {channels} channels, outside [1, {MAX_CHANNELS}]")
    g = math.gcd(rate, target_rate)
    if (rate // g) * (target_rate // g) > MAX_RESAMPLE_PHASES:
        raise ValueError(f"audio at {rate} Hz cannot be resampled to {target_rate} Hz within bounds "
                         f"(the ratio {rate // g}/{target_rate // g} needs too large a kernel)")


def header_seconds(data: bytes, target_rate: int = 16000) -> float:
    """Duration from the container header (no decode); ValueError for bytes that are not audio or
    whose header is out of bounds (check_header)."""
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as exc:  # libsndfile raises LibsndfileError/RuntimeError for anything unreadable
        raise ValueError(f"not a readable audio file ({type(exc).__name__}: {exc})") from None
    if info.samplerate <= 0 or info.frames <= 0:
        raise ValueError(f"audio header declares {info.frames} frames at {info.samplerate} Hz")
    check_header(info.samplerate, info.channels, target_rate)
    return info.frames / info.samplerate


def decode_waveform(data: bytes, config: AudioConfig) -> torch.Tensor:
    """float32 [samples] mono at config.sample_rate, cut to config.max_seconds."""
    import torch  # here, not at the top: the planner reads audio headers and never decodes

    with soundfile.SoundFile(io.BytesIO(data)) as f:
        rate = f.samplerate
        check_header(rate, f.channels, config.sample_rate)
        wave = f.read(frames=int(config.max_seconds * rate) + 1, dtype="float32", always_2d=True)
    mono = torch.from_numpy(wave.mean(axis=1) if wave.shape[1] > 1 else wave[:, 0])
    if rate != config.sample_rate:
        mono = _resampler(rate, config.sample_rate)(mono)
    mono = mono[: int(config.max_seconds * config.sample_rate)]
    if not torch.isfinite(mono).all() or mono.abs().max() > MAX_AMPLITUDE:
        raise ValueError("the audio holds non-finite or absurd samples (NaN, inf, or beyond +-1e4)")
    return mono


def log_mel(wave: torch.Tensor, config: AudioConfig, num_frames: int) -> np.ndarray:
    """float16 [num_frames, n_mels] natural-log mel power of a mono waveform."""
    import torch

    mel = _mel_transform(config)(wave)  # [n_mels, frames]
    frames = torch.log(mel.clamp_min(LOG_FLOOR)).T
    out = np.full((num_frames, config.n_mels), np.log(LOG_FLOOR), dtype=np.float16)
    used = min(num_frames, frames.shape[0])
    out[:used] = frames[:used].numpy()
    return out


def decode_audio(data: bytes, config: AudioConfig, num_frames: int) -> np.ndarray:
    """Encoded audio -> float16 [num_frames, n_mels] log-mel frames."""
    return log_mel(decode_waveform(data, config), config, num_frames)


SINC_WIDTH = 6
"""Zero crossings of the resampling filter on each side (torchaudio's default lowpass_filter_width)."""
ROLLOFF = 0.99
"""The filter's cutoff as a share of the lower rate's Nyquist frequency."""


@functools.lru_cache(maxsize=16)
def _resampler(orig: int, new: int):
    """A function resampling a float32 [samples] wave from ``orig`` to ``new`` Hz: a Hann-windowed
    sinc filter, one phase per output sample of a period, applied as a strided convolution."""
    import torch

    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    base = min(orig, new) * ROLLOFF
    taps = math.ceil(SINC_WIDTH * orig / base)
    idx = torch.arange(-taps, taps + orig, dtype=torch.float64)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx) * base
    t = t.clamp(-SINC_WIDTH, SINC_WIDTH)
    window = torch.cos(t * math.pi / SINC_WIDTH / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    kernel = (sinc * window * (base / orig)).to(torch.float32)  # [new, 1, 2 * taps + orig]

    def resample(wave: torch.Tensor) -> torch.Tensor:
        length = wave.shape[-1]
        padded = torch.nn.functional.pad(wave[None, None], (taps, taps + orig))
        out = torch.nn.functional.conv1d(padded, kernel, stride=orig)  # [1, new, periods]
        return out.transpose(1, 2).reshape(-1)[:math.ceil(new * length / orig)]

    return resample


def _hz_to_mel(hz: float) -> float:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    return hz * 3 / 200 if hz < 1000 else 15 + math.log(hz / 1000) / (math.log(6.4) / 27)


def mel_filters(config: AudioConfig):
    """float32 [n_fft // 2 + 1, n_mels]: Slaney-normalised triangular filters over the FFT bins."""
    import torch

    freqs = torch.linspace(0, config.sample_rate // 2, config.n_fft // 2 + 1, dtype=torch.float64)
    mels = torch.linspace(_hz_to_mel(0.0), _hz_to_mel(config.sample_rate / 2), config.n_mels + 2,
                          dtype=torch.float64)
    hz = torch.where(mels < 15, mels * 200 / 3, 1000 * torch.exp((math.log(6.4) / 27) * (mels - 15)))
    slopes = hz[None, :] - freqs[:, None]
    gaps = hz[1:] - hz[:-1]
    down, up = -slopes[:, :-2] / gaps[:-1], slopes[:, 2:] / gaps[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0)
    return (filters * (2.0 / (hz[2:] - hz[:-2]))[None, :]).to(torch.float32)


@functools.lru_cache(maxsize=4)
def _mel_transform(config: AudioConfig):
    """wave -> float32 [n_mels, frames] mel power: a centred, reflect-padded STFT with a periodic
    Hann window, |X|^2, the Slaney filters (as Whisper's front end)."""
    import torch

    window = torch.hann_window(config.n_fft)
    filters = mel_filters(config)

    def transform(wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wave, config.n_fft, config.hop_length, window=window, center=True, pad_mode="reflect",
                          return_complex=True)
        return filters.T @ spec.abs().pow(2)

    return transform
