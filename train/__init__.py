"""train: placeholder, filled by later issues."""
