"""parallel: placeholder, filled by later issues."""
