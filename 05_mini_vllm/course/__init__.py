"""Course support, not engine runtime: `tiny_models` loads the course's tiny
checkpoints through Hugging Face (tests and notebooks compare against it)."""
