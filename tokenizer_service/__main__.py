from radixserve.runtime.process_util import run_child
from tokenizer_service.server import serve

if __name__ == "__main__":
    run_child("tokenizer", serve, extra_args=("api_server_index",))
