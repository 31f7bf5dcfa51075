from radixserve.runtime.process_util import run_child
from scheduler_service.process import run_scheduler

if __name__ == "__main__":
    run_child("scheduler", run_scheduler)
