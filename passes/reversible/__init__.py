"""The reversible pass: find reversible segments (find), check and rewrite them (segments)."""
