"""Small generated image datasets: a COCO detection folder and a class-per-folder image tree."""

from __future__ import annotations

import json
import random
from pathlib import Path

_COLOURS = [(220, 40, 40), (40, 200, 60), (40, 80, 220), (230, 200, 30)]


def make_coco_folder(
    out_dir: str | Path, num_images: int = 8, size: int = 128, num_categories: int = 2, seed: int = 0
) -> str:
    """Write ``images/*.jpg`` and ``annotations.json`` (COCO instances format) with coloured boxes.

    Returns:
        ``out_dir`` as a string; read it with ``torchvision.datasets.CocoDetection``-style code
        (``images`` folder + ``annotations.json``).
    """
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    ann_id = 1
    for image_id in range(1, num_images + 1):
        img = Image.new("RGB", (size, size), (128, 128, 128))
        draw = ImageDraw.Draw(img)
        for _ in range(rng.randint(1, 3)):
            cat = rng.randint(1, num_categories)
            w, h = rng.randint(size // 8, size // 3), rng.randint(size // 8, size // 3)
            x, y = rng.randint(0, size - w - 1), rng.randint(0, size - h - 1)
            draw.rectangle([x, y, x + w, y + h], fill=_COLOURS[(cat - 1) % len(_COLOURS)])
            annotations.append(
                {"id": ann_id, "image_id": image_id, "category_id": cat, "bbox": [x, y, w, h],
                 "area": w * h, "iscrowd": 0}
            )
            ann_id += 1
        name = f"{image_id:06d}.jpg"
        img.save(out / "images" / name)
        images.append({"id": image_id, "file_name": name, "width": size, "height": size})
    categories = [{"id": c, "name": f"class{c}"} for c in range(1, num_categories + 1)]
    (out / "annotations.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    return str(out)


def make_image_folder(
    out_dir: str | Path, classes: tuple[str, ...] = ("cat", "dog"), images_per_class: int = 8, size: int = 64,
    seed: int = 0,
) -> str:
    """Write an ImageFolder tree (``<out_dir>/<class>/<n>.jpg``) of tinted noise images."""
    from PIL import Image

    rng = random.Random(seed)
    out = Path(out_dir)
    for ci, cls in enumerate(classes):
        (out / cls).mkdir(parents=True, exist_ok=True)
        base = _COLOURS[ci % len(_COLOURS)]
        for n in range(images_per_class):
            img = Image.new("RGB", (size, size), tuple(min(255, c + rng.randint(-30, 30)) for c in base))
            img.save(out / cls / f"{n:04d}.jpg")
    return str(out)
