"""Images as prompts carry them: a file path, base64 text, or a `data:` URL → decoded pixels.

`ImageRef` is what a sample keeps of an image: where it is (a path) and its content hash, never
its pixels. Base64 and data-URL images are written once into an `ImageStore` (a folder of
content-addressed files), so every later reader — the engine, the trainer in another process —
loads the same bytes from a path and checks the hash. Needs Pillow (the `local` extra).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verst.rollout.errors import DataError

_DATA_URL = "data:"
_PIL_FEATURE = "images in prompts"


class ImageError(DataError):
    """An image cannot be read (missing file, not an image, bad base64, hash mismatch)."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """Where one image's bytes are and what they hash to (the bounded part a sample keeps)."""

    path: str
    """A readable file holding the encoded image (the user's file, or the store's copy)."""
    sha256: str
    """Hex SHA-256 of the file's bytes: the image's identity (prefix sharing, layouts, checks)."""

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256}


def _pil() -> Any:
    from verst.rollout.engines.common.errors import require

    return require("PIL.Image", extra="local", feature=_PIL_FEATURE)


def decode_image(data: bytes, *, what: str) -> Any:
    """Encoded bytes → an RGB `PIL.Image`; `ImageError` naming `what` when they are not an image."""
    image_mod = _pil()
    try:
        with image_mod.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except image_mod.DecompressionBombError as exc:  # a few KB on disk that decode to gigabytes
        raise ImageError(
            f"{what}: refused as a decompression bomb ({exc}); fix: downscale the image below "
            f"{image_mod.MAX_IMAGE_PIXELS} pixels"
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's UnidentifiedImageError is an OSError
        raise ImageError(
            f"{what}: not a readable image ({type(exc).__name__}: {exc}); "
            f"fix: give a PNG/JPEG/GIF/BMP/WebP file or its base64"
        ) from None


def base64_bytes(text: str, *, what: str) -> bytes:
    """Base64 text or a `data:<mime>;base64,<...>` URL → its bytes (`ImageError` when malformed)."""
    payload = text
    if text.startswith(_DATA_URL):
        head, sep, payload = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError(f"{what}: a data URL must be 'data:<mime>;base64,<data>'; got {text[:40]!r}...")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(
            f"{what}: not valid base64 ({exc}); fix: encode the image bytes with base64"
        ) from None


class ImageStore:
    """A folder of images named by their SHA-256 (`<hash>.img`): each distinct image once."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def put(self, data: bytes) -> ImageRef:
        """Store `data` (idempotent) and return its reference."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.root / f"{digest}.img"
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{id(data)}")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: a concurrent reader never sees half a file
        return ImageRef(str(path), digest)


def resolve_image(
    value: str, *, what: str, store: ImageStore | None, base_dir: Path | None = None
) -> tuple[ImageRef, Any]:
    """A path, base64 text or data URL → (`ImageRef`, decoded RGB image).

    Paths are read in place (relative ones from `base_dir`); base64 goes into `store`, which is
    then required. `what` ("file:line", "message 2 part 1") prefixes every error.
    """
    if not isinstance(value, str) or not value:
        raise ImageError(f"{what}: an image must be a non-empty string (a path, base64 or a data URL)")
    path = Path(value) if len(value) < 4096 else None
    if path is not None and not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    is_file = path is not None and path.is_file()
    if value.startswith(_DATA_URL) or (not is_file and _looks_base64(value)):
        data = base64_bytes(value, what=what)
        image = decode_image(data, what=what)
        if store is None:  # kept in memory only (a server's request): no file to re-read later
            return ImageRef("", hashlib.sha256(data).hexdigest()), image
        return store.put(data), image
    if path is None or not is_file:
        raise ImageError(f"{what}: image file {str(path)!r} does not exist; fix: check the path")
    data = path.read_bytes()
    return ImageRef(str(path), hashlib.sha256(data).hexdigest()), decode_image(data, what=f"{what} ({path})")


def load_ref(ref: ImageRef) -> Any:
    """Read an `ImageRef` back, checking its hash (the file must not have changed since)."""
    if not ref.path:
        raise ImageError(
            f"image sha256 {ref.sha256[:12]} was given in memory only and has no file to re-read"
        )
    path = Path(ref.path)
    if not path.is_file():
        raise ImageError(
            f"image {ref.path!r} (sha256 {ref.sha256[:12]}) is gone; keep image files for the run"
        )
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise ImageError(
            f"image {ref.path!r} changed since it was read (sha256 {digest[:12]} != {ref.sha256[:12]}); "
            f"images must stay unchanged during a run"
        )
    return decode_image(data, what=ref.path)


def _looks_base64(value: str) -> bool:
    """Long text of base64 characters only, which no ordinary file path is."""
    if len(value) < 64:
        return False
    body = value.rstrip("=")
    return all(c.isalnum() or c in "+/" for c in body)
