"""placeholder"""
def check_deepspeed_plan(plan):
    pass
