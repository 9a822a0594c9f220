"""funnel"""
