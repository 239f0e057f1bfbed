"""vramcast: peak GPU memory of fine-tuning jobs, before they are placed."""
