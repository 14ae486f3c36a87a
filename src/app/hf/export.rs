//! A zerotrain checkpoint of a Hugging Face family written back as a Hugging Face folder.
