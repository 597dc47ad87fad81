"""data: placeholder, filled by later issues."""
