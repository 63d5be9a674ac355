"""Parallel modes as Lightning strategies, registered by name in Lightning's StrategyRegistry on import."""
