/* kernels/cuda/cuda_matmul_ops.cu — the backend's matmul ops (backend.h
 * matmul, matmul_cd and matmul_batched) as gemm_desc products of cuda_gemm
 * / cuda_gemm_cd (cuda_matmul.cu, or the emulated device's products), but
 * LoRA's rank-r products: those with a narrow output and a long reduction
 * (x A^T, dy B and the weight gradients), which cuda_skinny.cu's kernels
 * take, and those with a wide output and a reduction of the rank (xr B^T,
 * d(xr) A), which cuda_wide.cu's kernel takes. */
#include "cuda_internal.h"

extern "C" void cuda_matmul_cd(backend_t *be, tensor_t D, tensor_t C, tensor_t A, tensor_t B,
                               int M, int N, int K, int transA, int transB, float alpha,
                               float beta)
{
    if (be->err.code || M == 0 || N == 0)
        return;
    dtype_t adt = K > 0 ? A.dt : D.dt == DT_F32 ? DT_F32 : DT_BF16;
    gemm_desc d = gemm_desc_of(M, N, K, transA, transB, adt, K > 0 ? B.dt : adt, D.dt,
                               transA ? M : K, transB ? K : N, N, 1, 0, 0, 0);
    cuda_gemm_cd(be, &d, A.p, B.p, C.p, D.p, alpha, beta);
}

/* One strided batched product (cuBLASLt's batch count and strides: the
 * plan's layouts carry them) */
extern "C" void cuda_matmul_batched(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M,
                                    int N, int K, int transA, int transB, float alpha,
                                    float beta, int lda, int ldb, int ldc, int batch,
                                    unsigned long sa, unsigned long sb, unsigned long sc)
{
    if (be->err.code || M == 0 || N == 0)
        return;
    if (cuda_skinny_matmul(be, C, A, B, M, N, K, transA, transB, alpha, beta, lda, ldb, ldc,
                           batch, sa, sb, sc) ||
        cuda_wide_matmul(be, C, A, B, M, N, K, transA, transB, alpha, beta, lda, ldb, ldc, batch,
                         sa, sb, sc))
        return;
    dtype_t adt = K > 0 ? A.dt : C.dt == DT_F32 ? DT_F32 : DT_BF16;
    gemm_desc d = gemm_desc_of(M, N, K, transA, transB, adt, K > 0 ? B.dt : adt, C.dt, lda, ldb,
                               ldc, batch, (int64_t)sa, (int64_t)sb, (int64_t)sc);
    cuda_gemm(be, &d, A.p, B.p, C.p, alpha, beta);
}

extern "C" void cuda_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                            int transA, int transB, float alpha, float beta, int lda, int ldb,
                            int ldc)
{
    /* the shapes and dtypes have been checked (kernels/backend_ops.c);
     * cuda_gemm checks the dtype triple cuBLASLt multiplies */
    if (be->err.code || M == 0 || N == 0)
        return;
    if (cuda_skinny_matmul(be, C, A, B, M, N, K, transA, transB, alpha, beta, lda, ldb, ldc, 1,
                           0, 0, 0) ||
        cuda_wide_matmul(be, C, A, B, M, N, K, transA, transB, alpha, beta, lda, ldb, ldc, 1, 0,
                         0, 0))
        return;
    dtype_t adt = K > 0 ? A.dt : C.dt == DT_F32 ? DT_F32 : DT_BF16;
    gemm_desc d = gemm_desc_of(M, N, K, transA, transB, adt, K > 0 ? B.dt : adt, C.dt, lda, ldb,
                               ldc, 1, 0, 0, 0);
    cuda_gemm(be, &d, A.p, B.p, C.p, alpha, beta);
}
