"""Skip reasons are repeatable: the same sample fails with the same words in every process."""

import io

from PIL import Image, UnidentifiedImageError

from disttrain_api.errors import SampleError, repeatable


def test_a_librarys_object_address_is_left_out_of_a_reason():
    try:
        Image.open(io.BytesIO(b"not an image"))
    except UnidentifiedImageError as exc:
        text = str(exc)
    assert " at 0x" in text  # Pillow names the buffer it read, by its address
    error = SampleError("k", f"not a readable image ({text})", kind="unreadable_image")
    assert " at 0x" not in error.reason and "<_io.BytesIO object>" in error.reason
    assert repeatable(text) == repeatable(text.replace(text.split(" at 0x")[1][:6], "123456"))
