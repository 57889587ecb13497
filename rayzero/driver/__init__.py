"""rayzero.driver"""
