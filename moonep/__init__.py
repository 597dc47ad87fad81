"""moonep: placeholder, filled by later issues."""
