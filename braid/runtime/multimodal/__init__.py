"""Images for vision-language models, from what a user sends to what the model takes.

- `media`: `load_image` and `MediaLimits`: a path, bytes, PIL image, data/http(s)/file URL or
  bare base64 turned into a validated, fully decoded RGB image.
- `processor`: `ImageProcessor`: the model's own transformers image processor (its geometric
  steps, giving uint8 pixels), the prompt's image placeholder, and the image-token expansion.
- `frontend`: `MediaFrontend`, the front end's worker threads that turn a prompt's image
  sources into the images a request carries; `flatten_content` for chat content parts.
- `encoder_cache`: `EncoderCache`, the vision tower's outputs by image hash (scheduler side).

One processed image, as every process carries it, is `braid.runtime.image_data.ImageData`.
Import the modules themselves; this package imports nothing heavy.
"""
