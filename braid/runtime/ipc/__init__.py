"""Messages between the runtime's parts, one dataclass each, grouped by destination."""
