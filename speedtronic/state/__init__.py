"""What a checkpoint holds, and how it is written, found and restored."""
