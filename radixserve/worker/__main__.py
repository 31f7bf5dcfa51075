from radixserve.runtime.process_util import run_child
from radixserve.worker.worker import run_worker

if __name__ == "__main__":
    run_child("worker", run_worker, extra_args=("rank", "dist_init_method"))
