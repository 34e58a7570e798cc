"""Images in the runtime, without torch: reading them with limits (images.py), the vision graph's input made as the
family's processor makes it (preprocess.py), and an image's place among a prompt's token ids (image_prompt.py)."""
