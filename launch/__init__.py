"""launch: placeholder, filled by later issues."""
